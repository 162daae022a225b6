"""Typed settings, one tree per process kind: the only place a setting is
declared. See ``kinds`` for the kinds, ``load`` for the sources' order."""

from pipeline.settings.flags import add_settings
from pipeline.settings.kinds import (
    KINDS,
    BridgeProcess,
    CommonSettings,
    NatsProcess,
    UpProcess,
    WorkerProcess,
    load_kind,
)
from pipeline.settings.leaves import Leaf, SettingError, leaves
from pipeline.settings.load import SETTINGS_ENV, Loaded, handed_env, load

__all__ = [
    "KINDS",
    "SETTINGS_ENV",
    "BridgeProcess",
    "CommonSettings",
    "Leaf",
    "Loaded",
    "NatsProcess",
    "SettingError",
    "UpProcess",
    "WorkerProcess",
    "add_settings",
    "handed_env",
    "leaves",
    "load",
    "load_kind",
]
