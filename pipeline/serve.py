"""Running one process's part: a worker of a role, or the bridge. Used by the
CLI (one role per OS process) and by tests (in one event loop)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import signal
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web

from pipeline import tracing
from pipeline.bridge.app import Bridge, BridgeSettings
from pipeline.bridge.processing import BridgeProcessing, load_processor
from pipeline.canary import CanarySettings
from pipeline.config import PipelineConfig
from pipeline.connection import connect, shutdown
from pipeline.gc_heap import freeze_startup_heap
from pipeline.health import HealthSettings, WorkerHealth
from pipeline.kv_events import KvEventsSettings
from pipeline.metrics import show_engine_core
from pipeline.transport.base import TensorTransport, TransportSettings
from pipeline.worker import Worker
from schemas.chunk import MAX_INLINE_IMAGE
from schemas.processed import MediaKind
from schemas.routes import GENERATE_IMAGE, HOP_ROLES, PROCESSOR, holds_kv, moves_tensors
from schemas.settings import section, setting
from stages import compute_threads
from stages.contract import Stage, TensorStore
from stages.media import EmbeddingCache, MediaPolicy
from stages.models import DEFAULT_MODEL, ModelSpec, resolve_model
from stages.processor import Processor, ProcessorLimits
from stages.torch_engine.settings import DecodeSettings, intra_op_threads, step_priority_s
from stages.vllm_engine.args import STORAGE_TTL_S, KvConnectorSettings, engine_args_file, host_defaults

if TYPE_CHECKING:
    from stages.torch_engine.hop_engine import TorchHopEngine

log = structlog.get_logger(__name__)


ENGINES = ("torch", "vllm", "sglang")


@dataclass(frozen=True)
class WorkerSettings:
    """What a worker of any role runs with (the processor is a role too)."""

    model: str = setting(DEFAULT_MODEL, help="a built-in model name or a local checkpoint directory")
    served_model_name: str | None = setting(
        None, help="the model name clients send (unset: the built-in name, or the checkpoint folder's)"
    )
    device: str = setting("auto", help="auto (CUDA when torch sees a GPU, else CPU), cpu, cuda or cuda:N")
    image_model: str = setting(
        "",
        help="the generate-image stage's text-to-image pipeline: the built-in tiny-sd or a diffusers pipeline "
        "folder (unset: tiny-sd)",
    )
    image_cuda_graphs: bool = setting(
        True,
        help="the generate-image stage's denoiser (a diffusers pipeline's UNet) replayed from CUDA graphs, one a "
        "batch and size, captured on first use (off: its modules eagerly, as the pipeline alone runs them)",
    )
    image_inline_bytes: int = setting(
        MAX_INLINE_IMAGE,
        help="an image this size or smaller rides inside its reply chunk; a larger one waits in the tensor "
        "transport for the bridge to read (at most 1 MiB)",
    )
    max_inflight: int | None = setting(
        None,
        help="requests one worker runs at once; it fetches only while its KV pool has room (unset: --max-num-seqs)",
    )
    # vLLM's name and default: a cap, not a size; what runs is what the pool holds.
    max_num_seqs: int = setting(
        256,
        help="sequences one worker decodes together at most (its batch decoder's rows; one CUDA graph per "
        "power of two up to it); below it the KV pool's room decides how many run",
    )
    torch_threads: int | None = setting(
        None,
        help="torch's CPU threads (intra-op) of a built-in engine's thread; the worker's other threads compute on "
        "one each, so that only the engine keeps an OpenMP team (unset: 1 on a GPU worker, whose CPU ops are small "
        "and share the cores with its other threads; torch's default, one a core, on a CPU one)",
    )
    prefill_batch: int = setting(
        1,
        help="new prompts prefilled together in one forward when they wait together (1: each alone, generate()'s "
        "exact numerics; more: GPU throughput, last-bit differences)",
    )
    decode: DecodeSettings = section(DecodeSettings, "decoding (workers that decode)")
    media: MediaPolicy = section(MediaPolicy, "media limits (workers that encode)")
    limits: ProcessorLimits = section(ProcessorLimits, "request limits (the processor)")
    modalities: str = setting(
        "image", help="media kinds the processor accepts, comma separated: image, video, audio (others get 422)"
    )
    embedding_cache_bytes: int = setting(
        64 << 20, help="bytes of media embeddings an encoding worker keeps, keyed by content (0: off)"
    )
    canary: CanarySettings = section(CanarySettings, "canary health check")
    drain_grace_s: float = setting(
        30.0,
        flag="drain-grace",
        help="on SIGTERM, seconds to finish in-flight work before handing the rest to other workers",
    )
    # auto: NIXL when it imports, else the object store with a warning.
    transport: str = setting(
        "auto",
        choices=("auto", "nixl", "nats"),
        help="how tensors move between hops: NIXL, the NATS object store, or auto (NIXL if it imports)",
    )
    tensor_settings: TransportSettings = section(TransportSettings, "tensor hand-offs (workers that hand off)")
    health: HealthSettings = section(HealthSettings, "health and metrics endpoints (probes and Prometheus)")
    kv_events: KvEventsSettings = section(KvEventsSettings, "KV cache events (workers that hold a KV pool)")
    # None: where it can (below, runs_engine_process), as vLLM v1 runs its engine core.
    engine_process: bool | None = setting(
        None,
        help="run the built-in engine (model, KV cache, decode loop, media decoding, encoder) in a process of its "
        "own, under its own GIL, beside the worker's NATS traffic and chunks (roles that hand no tensors on: EPD; "
        "unset: on for such a role on a GPU, off on a CPU)",
    )
    engine: str = setting(
        "torch",
        choices=ENGINES,
        help="torch: the built-in engine; vllm: vLLM for the roles that prefill and decode (needs the vllm extra); "
        "sglang: SGLang for the roles that prefill or decode (needs the sglang extra)",
    )
    sglang_args: dict[str, Any] = setting(
        flag="sglang-arg",
        factory=dict,
        metavar="KEY=VALUE",
        help="an SGLang engine argument (sglang.Engine's, as its server's flags), e.g. context_length=4096 "
        "(repeatable; JSON values)",
    )
    vllm_args: dict[str, Any] = setting(
        flag="vllm-arg",
        factory=dict,
        metavar="KEY=VALUE",
        help="a vLLM engine argument, e.g. max_model_len=4096 or dtype=float32 (repeatable; JSON values)",
    )
    vllm_args_file: str = setting("", help="a JSON object of vLLM engine arguments (--vllm-arg wins)")
    vllm_kv: KvConnectorSettings = section(KvConnectorSettings, "vLLM's KV hand-off (--engine vllm)")
    # The vLLM encode role writes it, the vLLM prefill roles read it.
    vllm_ec_path: str = setting(
        "",
        help="the folder of vLLM's encoder-cache connector (ECExampleConnector), seen by the vLLM encode worker "
        "(which writes it) and the vLLM prefill workers (which read it); mmpipe up: <data-dir>/vllm-ec",
    )
    vllm_storage_ttl_s: float = setting(
        STORAGE_TTL_S,
        flag="vllm-storage-ttl",
        help="a vLLM worker that writes an example connector's folder (the vLLM encode worker: --vllm-ec-path; "
        "a prefill worker on ExampleConnector: --vllm-kv-path) deletes what in it has not changed for S "
        "seconds, every S/4 (0: never)",
    )

    def __post_init__(self) -> None:
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError("torch-threads must be at least 1")
        for name in ("max_num_seqs", "prefill_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be at least 1")
        if self.max_inflight is not None and self.max_inflight < 1:
            raise ValueError("max-inflight must be at least 1")
        if not 0 <= self.image_inline_bytes <= MAX_INLINE_IMAGE:
            raise ValueError(f"image-inline-bytes must be 0 to {MAX_INLINE_IMAGE}")

    @property
    def inflight(self) -> int:
        return self.max_inflight or self.max_num_seqs

    def engine_args(self) -> dict[str, Any]:
        """vLLM's engine arguments: this host's defaults, the file's over
        them, then --vllm-arg over those."""
        from_file = engine_args_file(self.vllm_args_file) if self.vllm_args_file else {}
        return {**host_defaults(resolve_device(self.device)), **from_file, **self.vllm_args}


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def parse_modalities(spec: str) -> frozenset[MediaKind]:
    kinds = [k.strip() for k in spec.split(",") if k.strip()]
    known = ", ".join(k.value for k in MediaKind)
    try:
        return frozenset(MediaKind(k) for k in kinds)
    except ValueError:
        raise SystemExit(f"--modalities {spec!r}: each must be one of {known}") from None


def build_processor(
    spec: ModelSpec,
    mode: str,
    limits: ProcessorLimits,
    modalities: str,
    media: MediaPolicy,
    tensors: TensorStore | None = None,
) -> Processor:
    """The processor of a model (a worker's or a bridge's own). With
    --frontend-decode, ``tensors`` holds the media it decodes."""
    from stages.models.traits import load_traits

    traits = load_traits(spec)
    frontend = None
    if media.frontend_decode:
        from stages.media.frontend import FrontendDecoder

        assert tensors is not None, "--frontend-decode needs a tensor transport"
        frontend = FrontendDecoder(media, tensors, traits.video_frame_multiple)
    return Processor(traits, mode=mode, limits=limits, modalities=parse_modalities(modalities), frontend=frontend)


def build_stage(
    role: str,
    config: PipelineConfig,
    settings: WorkerSettings,
    spec: ModelSpec | None = None,
    tensors: TensorStore | None = None,
) -> Stage:
    """The stage of a role, with its model loaded. Imports torch lazily: the
    bridge never needs it."""
    if role == GENERATE_IMAGE:
        return _image_stage(settings, tensors)
    spec = spec or resolve_model(settings.model, settings.served_model_name)
    if role == PROCESSOR:
        return build_processor(spec, config.mode, settings.limits, settings.modalities, settings.media, tensors)
    if role not in HOP_ROLES:
        raise SystemExit(f"unknown role {role!r}; roles: {PROCESSOR}, {', '.join(HOP_ROLES)}")
    if settings.engine == "sglang":
        if settings.engine_process:
            raise SystemExit("mmpipe: --engine-process is the built-in engine's (--engine torch)")
        return _sglang_stage(role, settings, spec, tensors)
    if settings.engine == "vllm":
        if settings.engine_process:
            # vLLM runs its engine core in a process of its own already.
            raise SystemExit("mmpipe: --engine-process is the built-in engine's (--engine torch)")
        return _vllm_stage(role, settings, spec, tensors)
    from stages.hop import HopStage

    if runs_engine_process(role, settings):
        from stages.torch_engine.core_client import ProcessHopEngine

        if settings.media.frontend_decode and "encode" in role.split("+"):
            # The engine core has no tensor transport to read the processor's media from.
            raise SystemExit("mmpipe: --frontend-decode and --engine-process do not go together")

        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        build = functools.partial(engine_core_hop_engine, role, settings, spec, str(level))
        try:
            return HopStage(role, ProcessHopEngine(role, build, Path(spec.path)), spec.served_name)
        except ValueError as exc:
            raise SystemExit(f"mmpipe: {exc}") from None
    return HopStage(role, build_torch_hop_engine(role, settings, spec, tensors), spec.served_name)


def runs_engine_process(role: str, settings: WorkerSettings) -> bool:
    """Whether a role's built-in engine runs in a core process of its own.
    Unset, on a GPU for a role that hands no tensors on (EPD) and takes no
    media from the processor: there the worker's host side is the wall, its
    event loop and the engine's thread taking turns at one GIL (H100, 2B
    preset, 64 clients, one call: 64.8 req/s with the core against 46.6 and
    50.4 without). Off on a CPU, where the engine's threads are the compute
    and every core counts."""
    if settings.engine_process is not None:
        return settings.engine_process
    return (
        settings.engine == "torch"
        and role in HOP_ROLES
        and not moves_tensors(role)
        and not reads_decoded_media(role, settings)
        and resolve_device(settings.device).startswith("cuda")
    )


def _image_stage(settings: WorkerSettings, tensors: TensorStore | None) -> Stage:
    from stages.image_engine.checkpoint import TINY_TEXT_TO_IMAGE, image_model_path
    from stages.image_engine.engine import ImageEngine
    from stages.image_engine.stage import ImageStage

    name = settings.image_model or TINY_TEXT_TO_IMAGE
    path = image_model_path(name)
    engine = ImageEngine(path, device=resolve_device(settings.device), cuda_graphs=settings.image_cuda_graphs)
    return ImageStage(engine, path.name, tensors, inline_bytes=settings.image_inline_bytes)


def build_torch_hop_engine(
    role: str, settings: WorkerSettings, spec: ModelSpec, tensors: TensorStore | None = None
) -> TorchHopEngine:
    """The built-in engine of a role, its model loaded."""
    from stages.torch_engine.engine import TorchEngine
    from stages.torch_engine.hop_engine import TorchHopEngine

    # A role that decodes keeps a batch decoder (and its preallocated cache);
    # one that ends at prefill, on a GPU, its slots to prefill into.
    steps = role.split("+")
    decode = dataclasses.replace(
        settings.decode,
        batched=settings.decode.batched and ("decode" in steps or "prefill" in steps),
        decodes="decode" in steps,
        encodes="encode" in steps,
        slots=settings.max_num_seqs,
    )
    device = resolve_device(settings.device)
    threads = intra_op_threads(settings.torch_threads, device)
    if compute_threads.engine_threads() is None and threads is not None:
        # Not a worker (a bench, a test): the threads are the process's.
        import torch

        torch.set_num_threads(threads)
    engine = TorchEngine(Path(spec.path), device=device, decode=decode)
    cache = EmbeddingCache(settings.embedding_cache_bytes, name=role) if role.startswith("encode") else None
    hop = TorchHopEngine(
        role,
        engine,
        tensors,
        media_policy=settings.media,
        max_batch=settings.max_num_seqs,
        embedding_cache=cache,
        prefill_batch=settings.prefill_batch,
        step_priority_s=step_priority_s(decode.step_priority_ms, str(engine.device)),
        gpu_call_spans=decode.gpu_call_spans,
        calls_ahead_of_step=decode.calls_ahead_of_step,
    )
    events = settings.kv_events
    if events.endpoint and engine.decoder is not None and engine.prefix_caching:
        from pipeline.kv_events import KvEventPublisher
        from schemas.kv_events import MEDIUM_CPU, MEDIUM_GPU
        from stages.torch_engine.kv_event_log import KvEventLog

        pool = engine.decoder.pool
        pool.log = KvEventLog(engine.block_size, MEDIUM_GPU if engine.device.type == "cuda" else MEDIUM_CPU)
        publisher = KvEventPublisher(pool.log, events.endpoint, events.replay_endpoint, events.topic)
        hop.closers.append(publisher.close)
        hop.kv_events_endpoint = events.endpoint
    return hop


def engine_core_hop_engine(role: str, settings: WorkerSettings, spec: ModelSpec, log_level: str) -> TorchHopEngine:
    """``build_torch_hop_engine`` as the engine core process runs it
    (``--engine-process``): its logs as the worker's."""
    from pipeline import logging as mm_logging

    mm_logging.configure(log_level)
    reserve_engine_threads(settings)
    return build_torch_hop_engine(role, settings, spec)


def _sglang_stage(role: str, settings: WorkerSettings, spec: ModelSpec, tensors: TensorStore | None) -> Stage:
    from stages.hop import HopStage

    try:
        from stages.sglang_engine import SGLANG_ROLES
        from stages.sglang_engine.hop_engine import SglangHopEngine
    except ImportError as exc:  # SGLang's own imports
        raise SystemExit(f"--engine sglang needs SGLang (bash deploy/install-sglang.sh): {exc}") from None
    if role not in SGLANG_ROLES:
        raise SystemExit(f"--engine sglang runs the roles {', '.join(SGLANG_ROLES)} so far, not {role}")
    from stages.sglang_engine.engine import SglangEngine

    device = resolve_device(settings.device)
    engine = SglangEngine(Path(spec.path), settings.sglang_args, device=device, role=role)
    encoder = None
    if role.startswith("encode"):
        from stages.encoder import MediaEncoder
        from stages.media import MediaFetcher
        from stages.torch_engine.engine import TorchEngine
        from stages.torch_engine.scheduler import EngineThread

        # mmpipe's encoder on a torch copy of the checkpoint, as beside vLLM.
        tower = TorchEngine(Path(spec.path), device=device, decode=DecodeSettings(batched=False))
        cache = EmbeddingCache(settings.embedding_cache_bytes, name=role)
        encoder = MediaEncoder(tower, EngineThread(), MediaFetcher(settings.media), settings.media, cache, tensors)
    try:
        return HopStage(role, SglangHopEngine(role, engine, tensors, encoder), spec.served_name)
    except ValueError as exc:
        raise SystemExit(f"mmpipe: {exc}") from None


def _vllm_stage(role: str, settings: WorkerSettings, spec: ModelSpec, tensors: TensorStore | None) -> Stage:
    from stages.vllm_engine import VLLM_ROLES, VllmUnavailable, require_vllm

    if role == "encode":
        return _vllm_encode_stage(settings, spec)
    if role not in VLLM_ROLES:
        raise SystemExit(f"--engine vllm runs the roles {', '.join(VLLM_ROLES)} so far, not {role}")
    try:
        require_vllm()
        from stages.vllm_engine.stage import build_vllm_stage

        engine_args = settings.engine_args()
        events = settings.kv_events
        if events.endpoint and "kv_events_config" not in engine_args:  # --vllm-arg wins
            engine_args["kv_events_config"] = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": events.endpoint,
                "replay_endpoint": events.replay_endpoint or None,
                "topic": events.topic,
            }
        stage = build_vllm_stage(
            role,
            Path(spec.path),
            spec.served_name,
            engine_args,
            tensors,
            device=resolve_device(settings.device),
            media_policy=settings.media,
            embedding_cache=EmbeddingCache(settings.embedding_cache_bytes, name=role)
            if role.startswith("encode")
            else None,
            kv=settings.vllm_kv,
            ec_path=settings.vllm_ec_path,
            storage_ttl_s=settings.vllm_storage_ttl_s,
        )
        if events.endpoint:
            stage.engine.kv_events_endpoint = events.endpoint  # type: ignore[attr-defined]
        return stage
    except (VllmUnavailable, ValueError) as exc:
        raise SystemExit(f"mmpipe: {exc}") from None


def _vllm_encode_stage(settings: WorkerSettings, spec: ModelSpec) -> Stage:
    """``encode`` on vLLM encoder-only (stages/vllm_engine/encoder_only.py)."""
    from stages.vllm_engine import VllmUnavailable, require_vllm

    policy = settings.media
    try:
        require_vllm()
        from stages.vllm_engine.encoder_only import build_vllm_encode_stage

        path = settings.vllm_ec_path
        return build_vllm_encode_stage(
            Path(spec.path), spec.served_name, settings.engine_args(), path, policy, settings.vllm_storage_ttl_s
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


def relayed_events(role: str, config: PipelineConfig, settings: WorkerSettings) -> WorkerSettings:
    """With --router kv, a worker that holds KV and was given no KV events
    endpoint publishes on one of its own, for the worker to relay on NATS."""
    if not config.router.kv or not holds_kv(role) or settings.kv_events.endpoint:
        return settings
    endpoint = f"ipc://{tempfile.gettempdir()}/mmpipe-kv-events-{uuid.uuid4().hex[:12]}"
    return dataclasses.replace(settings, kv_events=dataclasses.replace(settings.kv_events, endpoint=endpoint))


def reserve_engine_threads(settings: WorkerSettings) -> None:
    """This process's intra-op threads for its engine thread alone, the
    rest of its threads on one each (stages/compute_threads.py)."""
    compute_threads.reserve_on_loop(intra_op_threads(settings.torch_threads, resolve_device(settings.device)))


def computes_here(role: str, settings: WorkerSettings) -> bool:
    """Whether the built-in engine computes in this worker's process (not in
    an engine core process, nor in vLLM's or SGLang's)."""
    return role in HOP_ROLES and settings.engine == "torch" and not runs_engine_process(role, settings)


async def _serve_role(role: str, config: PipelineConfig, settings: WorkerSettings, health: WorkerHealth) -> None:
    settings = relayed_events(role, config, settings)
    if computes_here(role, settings):
        reserve_engine_threads(settings)
    nc, js = await connect(config.nats_url, name=f"mmpipe-{role}")
    tracing.attach_nats(nc, config.subjects.spans(role))
    tensors: TensorTransport | None = None
    try:
        # An image stage hands images over the inline limit to the bridge by reference.
        if moves_tensors(role) or reads_decoded_media(role, settings) or role == GENERATE_IMAGE:
            from pipeline.transport import open_transport

            # Its bucket is replicated like the streams (a new one; an existing one keeps its own).
            tensor_settings = dataclasses.replace(settings.tensor_settings, replicas=config.replicas or 1)
            device = resolve_device(settings.device)
            tensors = await open_transport(settings.transport, nc, js, config.namespace, tensor_settings, role, device)
        if role == PROCESSOR and settings.media.frontend_decode:
            _copies_only()
        stage = build_stage(role, config, settings, tensors=tensors)
        worker = Worker(
            nc,
            js,
            config,
            stage,
            max_inflight=settings.inflight,
            drain_grace_s=settings.drain_grace_s,
            tensors=tensors,
            kv_events_endpoint=settings.kv_events.endpoint if holds_kv(role) else "",
            canary=settings.canary,
            freeze_heap=True,
        )
        health.worker = worker
        _on_signals(worker.stop)
        # An engine core process (--engine-process) shows its metrics here.
        scrape = getattr(getattr(stage, "engine", None), "scrape", None)
        hide_core = show_engine_core(scrape) if scrape is not None else None
        try:
            await worker.run()
        finally:
            if hide_core is not None:
                hide_core()
    finally:
        if tensors is not None:
            await tensors.close()
        await shutdown(nc)


def _copies_only() -> None:
    """A process whose torch work is copies (decoded media into the tensor
    store) takes one intra-op thread: torch's default, one a core, spins
    every core after each small op (an H200 host's bridge with
    --frontend-decode: 122 ms of CPU a request against 12 without)."""
    import torch

    torch.set_num_threads(1)


def reads_decoded_media(role: str, settings: WorkerSettings) -> bool:
    """With --frontend-decode, the processor hands decoded media on and the
    role that encodes reads them: both need a tensor transport, EPD too."""
    return settings.media.frontend_decode and (role == PROCESSOR or "encode" in role.split("+"))


async def run_bridge(
    config: PipelineConfig, settings: BridgeSettings, processing: BridgeProcessing | None = None
) -> None:
    processing = processing or BridgeProcessing()
    nc, js = await connect(config.nats_url, name="mmpipe-bridge")
    tracing.attach_nats(nc, config.subjects.spans("bridge"))
    tensors: TensorTransport | None = None
    # Decoded media handed to encoders (--frontend-decode); images read from the workers that drew them.
    if (processing.model and processing.media.frontend_decode) or processing.image_model:
        _copies_only()
        from pipeline.transport import open_transport

        tensor_settings = dataclasses.replace(processing.tensor_settings, replicas=config.replicas or 1)
        tensors = await open_transport(processing.transport, nc, js, config.namespace, tensor_settings, "bridge")
    processor = load_processor(processing, config.mode, tensors)
    if processor is not None:
        processor.warm_up()
    image_model = Path(processing.image_model).name if processing.image_model else ""
    bridge = Bridge(nc, js, config, settings, processor, tensors, image_model=image_model)
    runner = web.AppRunner(bridge.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port)
    await site.start()
    log.info("bridge_started", url=f"http://{settings.host}:{settings.port}/v1")
    freeze_startup_heap()
    stopped = asyncio.Event()
    _on_signals(stopped.set)
    try:
        await stopped.wait()
    finally:
        await runner.cleanup()
        if processor is not None:
            await processor.close()
        if tensors is not None:
            await tensors.close()
        await shutdown(nc)
