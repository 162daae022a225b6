"""Running one process's part: a worker of a role, or the bridge. Used by the
CLI (one role per OS process) and by tests (in one event loop)."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog
from aiohttp import web

from pipeline.bridge.app import Bridge, BridgeSettings
from pipeline.config import PipelineConfig
from pipeline.connection import connect, shutdown
from pipeline.worker import Worker
from schemas.routes import PROCESSOR
from stages.contract import Stage
from stages.media import MediaPolicy
from stages.models import ModelSpec, resolve_model

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class WorkerSettings:
    model: str = "tiny-qwen2-vl"
    served_model_name: str | None = None
    device: str = "cpu"
    max_inflight: int = 8
    max_batch: int = 32
    allow_internal_media: bool = False
    drain_grace_s: float = 30.0


def build_stage(role: str, config: PipelineConfig, settings: WorkerSettings, spec: ModelSpec | None = None) -> Stage:
    """The stage of a role, with its model loaded. Imports torch lazily: the
    bridge never needs it."""
    spec = spec or resolve_model(settings.model, settings.served_model_name)
    if role == PROCESSOR:
        from stages.models.traits import load_traits
        from stages.processor import Processor

        return Processor(load_traits(spec), mode=config.mode)
    if role == "encode+prefill+decode":
        from stages.aggregated import AggregatedStage
        from stages.engine import TorchEngine

        engine = TorchEngine(Path(spec.path), device=settings.device)
        policy = MediaPolicy(allow_internal=settings.allow_internal_media)
        return AggregatedStage(engine, spec.served_name, media_policy=policy, max_batch=settings.max_batch)
    raise SystemExit(f"role {role!r} is not available yet; roles: {PROCESSOR}, encode+prefill+decode")


def _on_signals(stop: Callable[[], None]) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)


async def run_worker(role: str, config: PipelineConfig, settings: WorkerSettings) -> None:
    stage = build_stage(role, config, settings)
    nc, js = await connect(config.nats_url, name=f"mmpipe-{role}")
    worker = Worker(nc, js, config, stage, max_inflight=settings.max_inflight, drain_grace_s=settings.drain_grace_s)
    _on_signals(worker.stop)
    try:
        await worker.run()
    finally:
        await shutdown(nc)


async def run_bridge(config: PipelineConfig, settings: BridgeSettings) -> None:
    nc, js = await connect(config.nats_url, name="mmpipe-bridge")
    bridge = Bridge(nc, js, config, settings)
    runner = web.AppRunner(bridge.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port)
    await site.start()
    log.info("bridge_started", url=f"http://{settings.host}:{settings.port}/v1")
    stopped = asyncio.Event()
    _on_signals(stopped.set)
    try:
        await stopped.wait()
    finally:
        await runner.cleanup()
        await shutdown(nc)
