"""A process kind's settings as a flat list: the leaves of its dataclass tree.

Every name a user sees comes from here: the flag (``--max-inflight``), the
environment variable (``MMPIPE_MAX_INFLIGHT``), the config-file key
(``max-inflight`` or ``max_inflight``), the help group; and every value a user
gives is read by ``parse_text`` / ``parse_value`` into the field's type.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import types
import typing
from dataclasses import dataclass
from typing import Any

import msgspec

from schemas.settings import SECTION, SETTING, Setting

ENV_PREFIX = "MMPIPE_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class SettingError(ValueError):
    """A value a user gave that its setting cannot take; the message names both."""


# Compared and hashed by identity: one per setting of a kind (leaves() is cached).
@dataclass(frozen=True, eq=False)
class Leaf:
    # Field names from the kind's root to the setting.
    path: tuple[str, ...]
    info: Setting
    type: Any
    default: Any
    group: str

    @property
    def flag(self) -> str:
        return self.info.flag or self.path[-1].replace("_", "-")

    @property
    def key(self) -> str:
        """The config-file key (dashes; underscores are taken too)."""
        return self.flag

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.flag.upper().replace("-", "_")

    @property
    def dest(self) -> str:
        return "__".join(self.path)

    @property
    def base(self) -> Any:
        """The type without ``| None``."""
        args = [a for a in typing.get_args(self.type) if a is not type(None)]
        if _is_union(self.type) and len(args) == 1:
            return args[0]
        return self.type

    @property
    def optional(self) -> bool:
        return _is_union(self.type) and type(None) in typing.get_args(self.type)

    @property
    def kind(self) -> str:
        """bool, list, dict or scalar: how its flag takes values."""
        base = self.base
        origin = typing.get_origin(base) or base
        if base is bool:
            return "bool"
        if origin in (tuple, list, frozenset):
            return "list"
        if origin is dict:
            return "dict"
        return "scalar"

    def shown(self, value: Any) -> str:
        """A value as the user gives it (in the flag's units)."""
        if value is None:
            return "unset"
        if self.info.unit != 1 and isinstance(value, int | float):
            value = value / self.info.unit
            value = int(value) if float(value).is_integer() else value
        if isinstance(value, bool):
            return "on" if value else "off"
        if isinstance(value, tuple | list | frozenset):
            return ",".join(map(str, value)) or "none"
        if isinstance(value, dict):
            return json.dumps(value) if value else "none"
        return str(value) if value != "" else '""'


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def leaves(kind: Any) -> tuple[Leaf, ...]:
    """Every setting of a kind, in declaration order; flags are unique."""
    return _leaves(kind)


@functools.cache
def _leaves(kind: type) -> tuple[Leaf, ...]:
    out = tuple(_walk(kind, kind(), (), "settings"))
    seen: dict[str, Leaf] = {}
    for leaf in out:
        if leaf.flag in seen:
            raise TypeError(f"{kind.__name__}: --{leaf.flag} is both {seen[leaf.flag].dest} and {leaf.dest}")
        seen[leaf.flag] = leaf
    return out


def _walk(cls: type, instance: Any, path: tuple[str, ...], group: str) -> typing.Iterator[Leaf]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        value = getattr(instance, f.name)
        if SETTING in f.metadata:
            yield Leaf((*path, f.name), f.metadata[SETTING], hints[f.name], value, group)
        elif SECTION in f.metadata:
            yield from _walk(hints[f.name], value, (*path, f.name), f.metadata[SECTION])


def parse_text(leaf: Leaf, text: str, variable: bool = False) -> Any:
    """A value from a flag or a variable (always text). A list of paths in a
    variable is split as PATH is; in a flag, each flag is one path."""
    if leaf.optional and text.strip().lower() in ("", "none", "unset"):
        return None
    kind = leaf.kind
    if kind == "bool":
        word = text.strip().lower()
        if word in _TRUE | _FALSE:
            return word in _TRUE
        raise SettingError(f"{leaf.flag}: {text!r} is not on or off (true/false, 1/0, yes/no)")
    if kind == "list":
        if leaf.info.split:
            items = text.split(",")
        else:
            items = text.split(os.pathsep) if variable else [text]
        return [item.strip() for item in items if item.strip()]
    if kind == "dict":
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise SettingError(f"{leaf.flag}: a JSON object is needed, got {text!r}")
        return value
    if leaf.info.choices is not None:
        return _choice(leaf, text)
    return _scaled(leaf, _convert(leaf, text, strict=False))


def parse_value(leaf: Leaf, value: Any) -> Any:
    """A value from a config file (typed already: TOML numbers, lists, tables)."""
    if isinstance(value, str) and leaf.kind != "scalar":
        return parse_text(leaf, value)
    if isinstance(value, str) and leaf.info.choices is not None:
        return _choice(leaf, value)
    if leaf.kind == "dict":
        if not isinstance(value, dict):
            raise SettingError(f"{leaf.flag}: a table of KEY = VALUE is needed, got {value!r}")
        return {str(k).replace("-", "_"): v for k, v in value.items()}
    return _scaled(leaf, _convert(leaf, value, strict=False))


def parse_pairs(leaf: Leaf, pairs: list[str]) -> dict[str, Any]:
    """A dict setting's repeated ``KEY=VALUE`` flags; values are JSON where
    they parse (``4096``, ``true``, ``{"image": 4}``), else text."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        key = key.strip().lstrip("-").replace("-", "_")
        if not sep or not key:
            raise SettingError(f"--{leaf.flag} {pair!r}: KEY=VALUE is needed")
        try:
            out[key] = json.loads(text)
        except ValueError:
            out[key] = text
    return out


def _choice(leaf: Leaf, text: str) -> str:
    choices = leaf.info.choices or ()
    for choice in choices:
        if choice.lower() == text.strip().lower():
            return choice
    raise SettingError(f"{leaf.flag}: {text!r} is not one of {', '.join(choices)}")


def _convert(leaf: Leaf, value: Any, strict: bool) -> Any:
    try:
        return msgspec.convert(value, leaf.base, strict=strict)
    except msgspec.ValidationError as exc:
        raise SettingError(f"{leaf.flag}: {value!r}: {exc}") from None


def _scaled(leaf: Leaf, value: Any) -> Any:
    if leaf.info.unit == 1 or value is None:
        return value
    scaled = value * leaf.info.unit
    return int(scaled) if leaf.base is int else scaled
