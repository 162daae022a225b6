"""Pruning the folders vLLM's example connectors write and never empty.

ExampleConnector (the KV cache of a prompt, per layer) and
ECExampleConnector (an image's encoder output) write one folder per prompt
or item, ``<path>/<hash>/…safetensors``, and vLLM deletes none of them: a
deployment's disk would fill. A file is needed only between the worker
that writes it and the one that reads it (seconds), or by a takeover that
resumes the request later; one missing then restarts the request from its
first hop, which writes it again. So the workers that write a folder
delete what in it has not changed for ``ttl_s``, every ``ttl_s / 4``. Two
workers pruning one shared folder is harmless: a folder gone already is
skipped.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from typing import Final

import structlog
from prometheus_client import Counter

log = structlog.get_logger(__name__)

PRUNED: Final = Counter(
    "mmpipe_vllm_storage_pruned_total", "Entries deleted from a vLLM connector folder for age", ["folder"]
)
ERRORS: Final = Counter(
    "mmpipe_vllm_storage_prune_errors_total", "Failed prunes of a vLLM connector folder", ["folder"]
)


def _newest_change(entry: Path) -> float:
    newest = entry.lstat().st_mtime
    if entry.is_dir() and not entry.is_symlink():
        for child in entry.rglob("*"):
            try:
                newest = max(newest, child.lstat().st_mtime)
            except FileNotFoundError:
                continue
    return newest


def prune(folder: Path, ttl_s: float, now: float | None = None) -> int:
    """Delete the entries of ``folder`` unchanged for ``ttl_s``; returns how many."""
    now = time.time() if now is None else now
    removed = 0
    try:
        entries = list(folder.iterdir())
    except FileNotFoundError:
        return 0
    for entry in entries:
        try:
            if now - _newest_change(entry) <= ttl_s:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            removed += 1
        except FileNotFoundError:
            continue  # another worker pruned it first
    return removed


async def prune_forever(folder: Path, ttl_s: float, name: str) -> None:
    """``prune`` every ``ttl_s / 4`` until cancelled; errors are logged and
    counted, and the next round tries again."""
    while True:
        await asyncio.sleep(max(ttl_s / 4, 1.0))
        try:
            removed = await asyncio.to_thread(prune, folder, ttl_s)
        except Exception as exc:
            ERRORS.labels(name).inc()
            log.error("vllm_storage_prune_failed", folder=str(folder), error=repr(exc))
            continue
        if removed:
            PRUNED.labels(name).inc(removed)
            log.info("vllm_storage_pruned", folder=str(folder), removed=removed, ttl_s=ttl_s)
