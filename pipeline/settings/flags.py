"""A kind's settings as argparse flags, one help group per section.

No flag has an argparse default: a flag absent from the namespace was not
given, so the environment, the config file or the default shows through
(``load``). The help shows the built-in default and the variable.
"""

from __future__ import annotations

import argparse
from typing import Any

from pipeline.settings.leaves import Leaf, SettingError, leaves, parse_text
from pipeline.settings.load import CONFIG_ENV


def add_settings(parser: argparse.ArgumentParser, kind: type) -> None:
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=argparse.SUPPRESS,
        help=f"a TOML file of settings by flag name (max-inflight = 32); flags and MMPIPE_* variables beat it "
        f"(env {CONFIG_ENV})",
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for leaf in leaves(kind):
        group = groups.get(leaf.group)
        if group is None:
            group = groups[leaf.group] = parser.add_argument_group(leaf.group)
        group.add_argument(f"--{leaf.flag}", dest=leaf.dest, default=argparse.SUPPRESS, help=_help(leaf), **_how(leaf))


def _help(leaf: Leaf) -> str:
    text = f"{leaf.info.help} (default: {leaf.shown(leaf.default)}; env {leaf.env})"
    return text.replace("%", "%%")


def _how(leaf: Leaf) -> dict[str, Any]:
    kind = leaf.kind
    if kind == "bool":
        return {"action": argparse.BooleanOptionalAction}
    if kind in ("list", "dict"):
        return {"action": "append", "metavar": leaf.info.metavar or ("KEY=VALUE" if kind == "dict" else "VALUE")}
    how: dict[str, Any] = {"type": _typed(leaf)}
    if leaf.info.choices is not None:
        how["metavar"] = "{" + ",".join(leaf.info.choices) + "}"
    else:
        how["metavar"] = leaf.info.metavar or _metavar(leaf)
    return how


def _typed(leaf: Leaf) -> Any:
    def parse(text: str) -> Any:
        try:
            return parse_text(leaf, text)
        except SettingError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{leaf.flag}: ")) from None

    parse.__name__ = leaf.flag  # argparse names the type in its message
    return parse


def _metavar(leaf: Leaf) -> str:
    base = leaf.base
    if base is int:
        return "MiB" if leaf.info.unit == 1 << 20 else "N"
    if base is float:
        return "S" if leaf.path[-1].endswith("_s") else "X"
    return leaf.flag.rsplit("-", 1)[-1].upper()
