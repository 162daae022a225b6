"""The adapters bucket on a real nats-server: a registry opened later finds
what is served, and a watching one hears each load and unload."""

from __future__ import annotations

import asyncio
from typing import Any

from pipeline.config import PipelineConfig
from pipeline.lora import LoraRegistry


async def test_a_later_registry_finds_the_adapters_and_a_watching_one_hears_changes(
    pipeline_config: PipelineConfig, nats_client: Any
) -> None:
    _, js = nats_client
    subjects = pipeline_config.subjects
    bridge, worker = LoraRegistry(js, subjects), LoraRegistry(js, subjects)
    await bridge.open()
    await worker.open()
    heard: asyncio.Queue[tuple[str, str | None]] = asyncio.Queue()

    async def changed(name: str, path: str | None) -> None:
        await heard.put((name, path))

    worker.on_change = changed
    try:
        await bridge.put("sea", "/adapters/sea")
        await bridge.put("sky", "/adapters/sky")
        assert await asyncio.wait_for(heard.get(), 10) == ("sea", "/adapters/sea")
        assert await asyncio.wait_for(heard.get(), 10) == ("sky", "/adapters/sky")
        await bridge.delete("sea")
        assert await asyncio.wait_for(heard.get(), 10) == ("sea", None)
        assert worker.adapters == bridge.adapters == {"sky": "/adapters/sky"}
        # A worker started now loads what is served.
        later = LoraRegistry(js, subjects)
        await later.open()
        assert later.adapters == {"sky": "/adapters/sky"}
        await later.close()
    finally:
        await worker.close()
        await bridge.close()
