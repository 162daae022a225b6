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
skipped. vLLM reads an encoder output it finds again rather than writing it
anew, so the encode and prefill/decode workers touch an item's file when
they use it (``media.touch_ec_file``): an image in use stays.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from typing import Any, Final

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


def written_folders(engine_args: dict[str, Any]) -> list[tuple[Path, str]]:
    """The folders a vLLM engine of ``engine_args`` writes, each with its
    metrics label: ExampleConnector's as the KV producer (``kv``),
    ECExampleConnector's as the encoder-cache producer (``ec``). A
    connector set without a folder (vLLM's default) is left alone."""
    out: list[tuple[Path, str]] = []
    for kind, connector in (("kv", "ExampleConnector"), ("ec", "ECExampleConnector")):
        config = engine_args.get(f"{kind}_transfer_config") or {}
        path = (config.get(f"{kind}_connector_extra_config") or {}).get("shared_storage_path")
        producer = config.get(f"{kind}_role") in (f"{kind}_producer", f"{kind}_both")
        if config.get(f"{kind}_connector") == connector and producer and path:
            out.append((Path(path), kind))
    return out


class StoragePruner:
    """``prune_forever`` on each folder a vLLM engine writes, from
    ``start()`` to ``close()`` (``ttl_s`` 0: never)."""

    def __init__(self, folders: list[tuple[Path, str]], ttl_s: float) -> None:
        self.folders = folders
        self.ttl_s = ttl_s
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        if self.ttl_s <= 0:
            return
        for folder, name in self.folders:
            self._tasks.append(asyncio.create_task(prune_forever(folder, self.ttl_s, name)))
            log.info("vllm_storage_pruning", folder=str(folder), name=name, ttl_s=self.ttl_s)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tasks.clear()
