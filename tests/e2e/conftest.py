"""The whole EPD stack in the test's event loop: a real nats-server, the
processor and aggregated workers, the bridge on a free port."""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from PIL import Image

from pipeline.bridge.app import Bridge, BridgeSettings
from pipeline.config import PipelineConfig
from pipeline.connection import connect
from pipeline.serve import WorkerSettings, build_stage
from pipeline.worker import Worker
from stages.models import ModelSpec, resolve_model


def png_data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def gradient(width: int, height: int, seed: int) -> Image.Image:
    image = Image.new("RGB", (width, height))
    image.putdata(
        [
            ((x * 7 + seed * 31) % 256, (y * 5 + seed * 17) % 256, (x * y + seed) % 256)
            for y in range(height)
            for x in range(width)
        ]
    )
    return image


@dataclass
class Stack:
    base_url: str
    config: PipelineConfig
    spec: ModelSpec
    workers: list[Worker] = field(default_factory=list)
    nc: Any = None


@pytest.fixture
def model_spec(tiny_model_dir: Path) -> ModelSpec:
    return resolve_model(str(tiny_model_dir), "tiny-qwen2-vl")


async def start_stack(
    config: PipelineConfig, spec: ModelSpec, allow_internal: bool = True, bridge_settings: BridgeSettings | None = None
) -> tuple[Stack, Any]:
    tasks: list[asyncio.Task[None]] = []
    conns: list[Any] = []
    stack = Stack(base_url="", config=config, spec=spec)
    settings = WorkerSettings(
        model=str(spec.path), served_model_name=spec.served_name, allow_internal_media=allow_internal
    )
    for role in ("processor", "encode+prefill+decode"):
        nc, js = await connect(config.nats_url, f"test-{role}")
        conns.append(nc)
        worker = Worker(nc, js, config, build_stage(role, config, settings, spec), max_inflight=8)
        stack.workers.append(worker)
        tasks.append(asyncio.create_task(worker.run()))
        await asyncio.wait_for(worker.ready.wait(), 60)
    nc, js = await connect(config.nats_url, "test-bridge")
    conns.append(nc)
    stack.nc = nc
    bridge = Bridge(nc, js, config, bridge_settings or BridgeSettings(port=0))
    runner = web.AppRunner(bridge.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    stack.base_url = f"http://{host}:{port}"

    async def stop() -> None:
        await runner.cleanup()
        for worker in stack.workers:
            worker.stop()
        await asyncio.gather(*tasks)
        for conn in conns:
            await conn.close()

    return stack, stop


@pytest.fixture
async def stack(pipeline_config: PipelineConfig, model_spec: ModelSpec) -> AsyncIterator[Stack]:
    s, stop = await start_stack(pipeline_config, model_spec)
    yield s
    await stop()


@pytest.fixture
async def image_server() -> AsyncIterator[str]:
    """Serves test images over http on loopback (reachable only with allow-internal)."""
    images = {f"/img{i}.png": gradient(40 + 16 * i, 56 + 8 * i, i) for i in range(8)}

    async def handle(request: web.Request) -> web.Response:
        image = images.get(request.path)
        if image is None:
            return web.Response(status=404)
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return web.Response(body=buf.getvalue(), content_type="image/png")

    app = web.Application()
    app.router.add_get("/{name}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    yield f"http://{host}:{port}"
    await runner.cleanup()
