"""Running one process's part: a worker of a role, or the bridge. Used by the
CLI (one role per OS process) and by tests (in one event loop)."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from aiohttp import web

from pipeline.bridge.app import Bridge, BridgeSettings
from pipeline.config import PipelineConfig
from pipeline.connection import connect, shutdown
from pipeline.health import HealthSettings, WorkerHealth
from pipeline.transport.base import TensorTransport, TransportSettings
from pipeline.worker import Worker
from schemas.processed import MediaKind
from schemas.routes import HOP_ROLES, PROCESSOR, moves_tensors
from stages.contract import Stage, TensorStore
from stages.media import EmbeddingCache, MediaPolicy
from stages.models import ModelSpec, resolve_model
from stages.processor import ProcessorLimits
from stages.torch_engine.settings import DecodeSettings
from stages.vllm_engine.args import STORAGE_TTL_S, KvConnectorSettings

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class WorkerSettings:
    model: str = "tiny-qwen2-vl"
    served_model_name: str | None = None
    device: str = "cpu"
    max_inflight: int = 8
    max_batch: int = 32
    prefill_batch: int = 1
    # The batch decoder of a decoding role (slots, cache length, CUDA graphs).
    decode: DecodeSettings = field(default_factory=DecodeSettings)
    allow_internal_media: bool = False
    # Media limits (bytes, pixels, frames, seconds, local directories); allow_internal_media overrides its switch.
    media: MediaPolicy = field(default_factory=MediaPolicy)
    # What the processor accepts (media per request, prompt tokens, max_tokens default).
    limits: ProcessorLimits = field(default_factory=ProcessorLimits)
    # Media kinds the processor accepts, comma separated.
    modalities: str = "image"
    # Embeddings kept by a worker that encodes, keyed by media content (0: off).
    embedding_cache_bytes: int = 64 << 20
    drain_grace_s: float = 30.0
    # "nixl", "nats" (the JetStream object store) or "auto": NIXL when it
    # imports, else the object store with a warning.
    transport: str = "auto"
    tensor_settings: TransportSettings = field(default_factory=TransportSettings)
    # /health/ready, /health/live and /metrics on a port of its own (port 0: none).
    health: HealthSettings = field(default_factory=HealthSettings)
    # "torch" (built in) or "vllm" (the roles that prefill and decode together),
    # with vLLM's engine arguments passed through.
    engine: str = "torch"
    vllm_args: dict[str, Any] = field(default_factory=dict)
    # How a vLLM prefill hands the KV cache to a vLLM decode (those roles only).
    vllm_kv: KvConnectorSettings = field(default_factory=KvConnectorSettings)
    # vLLM's encoder-cache folder (--vllm-ec-path): the vLLM encode role
    # writes it, the vLLM prefill roles read it.
    vllm_ec_path: str = ""
    # --vllm-storage-ttl: a vLLM worker that writes an example connector's
    # folder deletes what in it is older (0: never).
    vllm_storage_ttl_s: float = STORAGE_TTL_S


def parse_modalities(spec: str) -> frozenset[MediaKind]:
    kinds = [k.strip() for k in spec.split(",") if k.strip()]
    known = ", ".join(k.value for k in MediaKind)
    try:
        return frozenset(MediaKind(k) for k in kinds)
    except ValueError:
        raise SystemExit(f"--modalities {spec!r}: each must be one of {known}") from None


def build_stage(
    role: str,
    config: PipelineConfig,
    settings: WorkerSettings,
    spec: ModelSpec | None = None,
    tensors: TensorStore | None = None,
) -> Stage:
    """The stage of a role, with its model loaded. Imports torch lazily: the
    bridge never needs it."""
    spec = spec or resolve_model(settings.model, settings.served_model_name)
    if role == PROCESSOR:
        from stages.models.traits import load_traits
        from stages.processor import Processor

        return Processor(
            load_traits(spec),
            mode=config.mode,
            limits=settings.limits,
            modalities=parse_modalities(settings.modalities),
        )
    if role not in HOP_ROLES:
        raise SystemExit(f"unknown role {role!r}; roles: {PROCESSOR}, {', '.join(HOP_ROLES)}")
    if settings.engine == "vllm":
        return _vllm_stage(role, settings, spec, tensors)
    from stages.hop import HopStage
    from stages.torch_engine.engine import TorchEngine
    from stages.torch_engine.hop_engine import TorchHopEngine

    # Only a role that decodes keeps a batch decoder (and its preallocated cache).
    decode = dataclasses.replace(settings.decode, batched=settings.decode.batched and "decode" in role.split("+"))
    engine = TorchEngine(Path(spec.path), device=settings.device, decode=decode)
    policy = dataclasses.replace(settings.media, allow_internal=settings.allow_internal_media)
    cache = EmbeddingCache(settings.embedding_cache_bytes, name=role) if role.startswith("encode") else None
    hop_engine = TorchHopEngine(
        role,
        engine,
        tensors,
        media_policy=policy,
        max_batch=settings.max_batch,
        embedding_cache=cache,
        prefill_batch=settings.prefill_batch,
    )
    return HopStage(role, hop_engine, spec.served_name)


def _vllm_stage(role: str, settings: WorkerSettings, spec: ModelSpec, tensors: TensorStore | None) -> Stage:
    from stages.vllm_engine import VLLM_ROLES, VllmUnavailable, require_vllm

    if role == "encode":
        return _vllm_encode_stage(settings, spec)
    if role not in VLLM_ROLES:
        raise SystemExit(f"--engine vllm runs the roles {', '.join(VLLM_ROLES)} so far, not {role}")
    try:
        require_vllm()
        from stages.vllm_engine.stage import build_vllm_stage

        return build_vllm_stage(
            role,
            Path(spec.path),
            spec.served_name,
            settings.vllm_args,
            tensors,
            device=settings.device,
            media_policy=dataclasses.replace(settings.media, allow_internal=settings.allow_internal_media),
            embedding_cache=EmbeddingCache(settings.embedding_cache_bytes, name=role)
            if role.startswith("encode")
            else None,
            kv=settings.vllm_kv,
            ec_path=settings.vllm_ec_path,
            storage_ttl_s=settings.vllm_storage_ttl_s,
        )
    except (VllmUnavailable, ValueError) as exc:
        raise SystemExit(f"mmpipe: {exc}") from None


def _vllm_encode_stage(settings: WorkerSettings, spec: ModelSpec) -> Stage:
    """``encode`` on vLLM encoder-only (stages/vllm_engine/encoder_only.py)."""
    from stages.vllm_engine import VllmUnavailable, require_vllm

    policy = dataclasses.replace(settings.media, allow_internal=settings.allow_internal_media)
    try:
        require_vllm()
        from stages.vllm_engine.encoder_only import build_vllm_encode_stage

        path = settings.vllm_ec_path
        return build_vllm_encode_stage(
            Path(spec.path), spec.served_name, settings.vllm_args, path, policy, settings.vllm_storage_ttl_s
        )
    except (VllmUnavailable, ValueError) as exc:
        raise SystemExit(f"mmpipe: {exc}") from None


def _on_signals(stop: Callable[[], None]) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)


async def run_worker(role: str, config: PipelineConfig, settings: WorkerSettings) -> None:
    # The endpoints answer from the start: live but not ready while NATS is
    # not reached yet (the model load blocks the loop; a startup probe covers it).
    health = WorkerHealth(settings.health)
    if settings.health.port:
        await health.serve()
    try:
        await _serve_role(role, config, settings, health)
    finally:
        await health.close()


async def _serve_role(role: str, config: PipelineConfig, settings: WorkerSettings, health: WorkerHealth) -> None:
    nc, js = await connect(config.nats_url, name=f"mmpipe-{role}")
    tensors: TensorTransport | None = None
    try:
        if moves_tensors(role):
            from pipeline.transport import open_transport

            # Its bucket is replicated like the streams (a new one; an existing one keeps its own).
            tensor_settings = dataclasses.replace(settings.tensor_settings, replicas=config.replicas or 1)
            tensors = await open_transport(
                settings.transport, nc, js, config.namespace, tensor_settings, role, settings.device
            )
        stage = build_stage(role, config, settings, tensors=tensors)
        worker = Worker(
            nc,
            js,
            config,
            stage,
            max_inflight=settings.max_inflight,
            drain_grace_s=settings.drain_grace_s,
            tensors=tensors,
        )
        health.worker = worker
        _on_signals(worker.stop)
        await worker.run()
    finally:
        if tensors is not None:
            await tensors.close()
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
