"""Where a running ``mmpipe up`` can be reached: it records its NATS URL
under its data dir, and commands run beside it (``mmpipe send``) read it
there instead of guessing a port (the embedded server takes any free one)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

RECORD = "nats.url"


def record_nats_url(data_dir: Path, url: str) -> Path:
    """Write ``url`` where ``recorded_nats_url`` finds it (atomically: a
    reader never sees half a URL)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / RECORD
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(url + "\n")
    partial.replace(path)
    return path


def recorded_nats_url(data_dir: Path) -> str | None:
    try:
        url = (data_dir / RECORD).read_text().strip()
    except OSError:
        return None
    return url or None


def nats_url_beside_up(given: str | None, data_dir: Path, default: str) -> tuple[str, str]:
    """The NATS URL a command run beside ``mmpipe up`` uses, and what said
    so: ``given`` (its ``--nats-url``), else what the ``mmpipe up`` of
    ``data_dir`` recorded, else ``default``."""
    if given:
        return given, "--nats-url"
    recorded = recorded_nats_url(data_dir)
    if recorded is not None:
        return recorded, f"recorded in {data_dir / RECORD} by mmpipe up"
    return default, f"the default; no mmpipe up recorded one in {data_dir}"


def forget_nats_url(data_dir: Path, url: str) -> None:
    """Remove the record if it is still ``url`` (another ``up`` on the same
    data dir may have written its own since)."""
    if recorded_nats_url(data_dir) == url:
        with contextlib.suppress(OSError):
            (data_dir / RECORD).unlink()
