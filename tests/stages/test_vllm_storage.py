"""Pruning a vLLM connector folder by age (no vLLM needed: plain files laid
out as the example connectors write them)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from stages.vllm_engine.args import KvConnectorSettings, kv_transfer_config
from stages.vllm_engine.media import ec_transfer_config
from stages.vllm_engine.storage import PRUNED, StoragePruner, prune, prune_forever, written_folders


def _item(folder: Path, name: str, age_s: float, now: float) -> Path:
    item = folder / name
    item.mkdir(parents=True)
    data = item / "encoder_cache.safetensors"
    data.write_bytes(b"x" * 16)
    for path in (data, item):
        os.utime(path, (now - age_s, now - age_s))
    return item


def test_only_entries_unchanged_for_the_ttl_go(tmp_path: Path) -> None:
    now = time.time()
    old = _item(tmp_path, "old", 700, now)
    fresh = _item(tmp_path, "fresh", 10, now)
    touched = _item(tmp_path, "touched", 700, now)
    (touched / "model-layers-1.safetensors").write_bytes(b"y")  # a file written into it just now
    stray = tmp_path / "stray.tmp"
    stray.write_bytes(b"z")
    os.utime(stray, (now - 900, now - 900))
    assert prune(tmp_path, ttl_s=600, now=now) == 2
    assert not old.exists() and not stray.exists() and fresh.exists() and touched.exists()
    assert prune(tmp_path / "missing", ttl_s=600) == 0


def _empty(folder: Path) -> bool:
    return not any(folder.iterdir())


async def test_prune_forever_counts_what_it_deletes(tmp_path: Path) -> None:
    before = PRUNED.labels("ec")._value.get()
    _item(tmp_path, "old", 60, time.time())
    task = asyncio.create_task(prune_forever(tmp_path, ttl_s=4.0, name="ec"))
    try:
        for _ in range(60):
            if PRUNED.labels("ec")._value.get() > before:
                break
            await asyncio.sleep(0.1)
    finally:
        task.cancel()
    assert _empty(tmp_path)
    assert PRUNED.labels("ec")._value.get() == before + 1


def test_the_folders_a_producer_writes(tmp_path: Path) -> None:
    kv = KvConnectorSettings("example", str(tmp_path / "kv"))
    prefill = {"kv_transfer_config": kv_transfer_config("prefill", kv)}
    assert written_folders(prefill) == [(tmp_path / "kv", "kv")]
    encode = {"ec_transfer_config": ec_transfer_config(True, tmp_path / "ec")}
    assert written_folders(encode) == [(tmp_path / "ec", "ec")]
    # A vLLM prefill after a vLLM encoder: reads the encoder cache, writes the KV cache.
    both = {**prefill, "ec_transfer_config": ec_transfer_config(False, tmp_path / "ec")}
    assert written_folders(both) == [(tmp_path / "kv", "kv")]
    assert written_folders({"kv_transfer_config": kv_transfer_config("decode", kv)}) == []
    assert written_folders({"kv_transfer_config": kv_transfer_config("prefill", KvConnectorSettings("nixl"))}) == []
    no_folder = {"kv_transfer_config": {"kv_connector": "ExampleConnector", "kv_role": "kv_producer"}}
    assert written_folders(no_folder) == []  # vLLM's default folder is left alone
    assert written_folders({}) == []


async def test_the_pruner_runs_from_start_to_close(tmp_path: Path) -> None:
    before = PRUNED.labels("kv")._value.get()
    _item(tmp_path, "old", 60, time.time())
    pruner = StoragePruner([(tmp_path, "kv")], ttl_s=4.0)
    pruner.start()
    try:
        for _ in range(60):
            if _empty(tmp_path):
                break
            await asyncio.sleep(0.1)
    finally:
        pruner.close()
    assert _empty(tmp_path) and PRUNED.labels("kv")._value.get() == before + 1
    await asyncio.sleep(0)
    _item(tmp_path, "later", 60, time.time())
    await asyncio.sleep(1.5)  # closed: nothing prunes any more
    assert not _empty(tmp_path)
    never = StoragePruner([(tmp_path, "kv")], ttl_s=0)  # --vllm-storage-ttl 0
    never.start()
    await asyncio.sleep(1.5)
    never.close()
    assert not _empty(tmp_path)
