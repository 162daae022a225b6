"""Settings from their sources: flags beat environment beat config file beat
defaults; a process ``mmpipe up`` started takes its settings whole from the
JSON it was handed (``MMPIPE_SETTINGS_JSON``), flags still beating it."""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import msgspec

from pipeline.settings.leaves import Leaf, SettingError, leaves, parse_pairs, parse_text, parse_value

T = TypeVar("T")

# What `mmpipe up` hands a child: {"kind": ..., "settings": {...}}. In the
# environment, not argv: it holds the API key and NATS credentials.
SETTINGS_ENV = "MMPIPE_SETTINGS_JSON"
CONFIG_ENV = "MMPIPE_CONFIG"


@dataclass(frozen=True)
class Loaded(Generic[T]):
    settings: T
    # Settings some source gave (a flag, a variable, the file): the rest are defaults.
    given: frozenset[str]


def load(
    kind: type[T],
    name: str,
    args: argparse.Namespace | None = None,
    environ: Mapping[str, str] | None = None,
    known_keys: frozenset[str] = frozenset(),
) -> Loaded[T]:
    """``name`` tags the JSON a parent hands over (a worker never takes a
    bridge's); ``known_keys``: config-file keys other kinds take, which this
    one skips (one file can serve a whole deployment) where an unknown key
    is an error."""
    env = os.environ if environ is None else environ
    ls = leaves(kind)
    tree: dict[str, Any] = msgspec.to_builtins(kind())
    given: set[str] = set()
    handed = _handed(env.get(SETTINGS_ENV), name)
    if handed is not None:
        tree = handed
    else:
        config = getattr(args, "config", None) or env.get(CONFIG_ENV)
        if config:
            for leaf, value in _from_file(Path(config), ls, known_keys):
                _put(tree, leaf, value, given)
        for leaf in ls:
            if leaf.env in env:
                _put(tree, leaf, _parsed(f"${leaf.env}", _from_variable, leaf, env[leaf.env]), given)
    for leaf in ls:
        if args is not None and hasattr(args, leaf.dest):
            raw = getattr(args, leaf.dest)
            _put(tree, leaf, _from_flag(leaf, raw), given)
    try:
        settings = msgspec.convert(tree, kind)
    except msgspec.ValidationError as exc:
        raise SettingError(str(exc).split(" - at ")[0]) from None
    return Loaded(settings, frozenset(given))


def handed_env(name: str, settings: Any) -> dict[str, str]:
    """The variable that hands ``settings`` of kind ``name`` to a child process."""
    return {SETTINGS_ENV: msgspec.json.encode({"kind": name, "settings": settings}).decode()}


def _handed(text: str | None, name: str) -> dict[str, Any] | None:
    if not text:
        return None
    payload = msgspec.json.decode(text)
    if not isinstance(payload, dict) or payload.get("kind") != name:
        return None
    settings: dict[str, Any] = payload["settings"]
    return settings


def _from_variable(leaf: Leaf, text: str) -> Any:
    return parse_text(leaf, text, variable=True)


def _from_flag(leaf: Leaf, raw: Any) -> Any:
    # argparse ran parse_text on scalars already; repeated flags come as lists.
    if leaf.kind == "dict":
        return parse_pairs(leaf, raw)
    if leaf.kind == "list":
        return [item for text in raw for item in parse_text(leaf, text)]
    return raw


def _from_file(path: Path, ls: tuple[Leaf, ...], known_keys: frozenset[str]) -> list[tuple[Leaf, Any]]:
    try:
        with path.open("rb") as f:
            table = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SettingError(f"--config {path}: {exc}") from None
    by_key = {leaf.key: leaf for leaf in ls}
    out: list[tuple[Leaf, Any]] = []
    for key, value in table.items():
        normal = key.replace("_", "-")
        leaf = by_key.get(normal)
        if leaf is None:
            if normal in known_keys:
                continue
            raise SettingError(f"--config {path}: {key!r} is no setting (see mmpipe up --help)")
        out.append((leaf, _parsed(f"{path}: {key}", parse_value, leaf, value)))
    return out


def _parsed(where: str, parse: Callable[[Leaf, Any], Any], leaf: Leaf, value: Any) -> Any:
    try:
        return parse(leaf, value)
    except SettingError as exc:
        raise SettingError(f"{where}: {exc}") from None


def _put(tree: dict[str, Any], leaf: Leaf, value: Any, given: set[str]) -> None:
    node = tree
    for name in leaf.path[:-1]:
        node = node[name]
    node[leaf.path[-1]] = msgspec.to_builtins(value)
    given.add(leaf.dest)
