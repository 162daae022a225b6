"""How a setting is declared.

A setting is a field of a frozen dataclass carrying ``Setting`` metadata; a
field holding another such dataclass is a section. ``pipeline.settings``
walks a process kind's dataclass tree and makes, from these declarations
alone, its command-line flags, its ``MMPIPE_<FLAG>`` environment variables,
its config-file keys and the JSON ``mmpipe up`` hands its children. Fields
without the metadata are the code's own constants, not settings.

Declared here, beside the wire, because both ``stages`` (media limits, the
decoder) and ``pipeline`` (NATS, the bridge) own settings, and neither may
import the other's side.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SETTING = "mmpipe.setting"
SECTION = "mmpipe.section"


@dataclass(frozen=True)
class Setting:
    help: str
    # The long option without dashes; None: the field's name with - for _.
    flag: str | None = None
    choices: tuple[str, ...] | None = None
    # The flag, its variable and its config key give the value in these
    # units: a MiB flag on a field that holds bytes has unit 1 << 20.
    unit: int = 1
    # A list setting's flag is repeatable; split: each value also splits at
    # commas (not for paths).
    split: bool = True
    metavar: str | None = None


def setting(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    flag: str | None = None,
    choices: tuple[str, ...] | None = None,
    unit: int = 1,
    split: bool = True,
    metavar: str | None = None,
    factory: Callable[[], Any] | None = None,
) -> Any:
    """A dataclass field that is a setting."""
    meta = {SETTING: Setting(help, flag, choices, unit, split, metavar)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def section(factory: Callable[[], Any], title: str) -> Any:
    """A dataclass field holding a group of settings (one help group)."""
    return dataclasses.field(default_factory=factory, metadata={SECTION: title})
