"""The worker runtime: one durable pull consumer per role, a bounded number of
messages in flight, ack only after every output is stored."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import MaxPayloadError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.errors import APIError
from opentelemetry.trace import Span

from pipeline import metrics, tracing
from pipeline.canary import Canary, CanarySettings
from pipeline.cancel import CancelRegistry
from pipeline.config import PipelineConfig
from pipeline.gc_heap import freeze_startup_heap
from pipeline.lora import LoraRegistry
from pipeline.outcomes import Ack, Nak, Outcome, Reject, outcome_for
from pipeline.replies import ReplyPublisher
from pipeline.router.inbox import RoutedInbox
from pipeline.router.relay import KvEventRelay
from pipeline.router.reports import WorkerReports
from pipeline.router.router import KvRouter
from pipeline.settle import Settler
from pipeline.streams import ensure_consumer, ensure_streams, is_not_now, is_stream_full
from pipeline.subjects import check_token, role_token
from pipeline.transport.base import TensorGone, TensorTransport
from schemas.chunk import ReplyChunk, TokenChunk
from schemas.codec import CONTENT_TYPE, MSGPACK, Decoder, encode
from schemas.control import (
    CacheCleared,
    LoraCommand,
    LoraState,
    Restart,
    Sleep,
    SleepState,
    WorkerInfo,
    WorkerLoad,
)
from schemas.errors import (
    DeadlineExceeded,
    InternalError,
    InvalidRequest,
    MmpipeError,
    TooLarge,
    TransientError,
)
from schemas.processed import ProcessedRequest
from schemas.request import GenerateRequest
from schemas.routes import HOP_ROLES, PROCESSOR
from schemas.tensors import TensorRef
from stages.contract import HopContext, Stage

log = structlog.get_logger(__name__)

# NATS counts a message's headers against max_payload too.
_HEADER_ROOM = 1024
_SLEEP: Decoder[Sleep] = Decoder(Sleep)
_LORA: Decoder[LoraCommand] = Decoder(LoraCommand)
# The roles that forward a hop a router places (the processor the first, encode the next).
_ROUTING_ROLES = (PROCESSOR, "encode")


def _raise_if_cancelled() -> None:
    """nats-py swallows a CancelledError that lands inside a publish (its
    flush path catches it), so a cancel, a drain or a deadline could be lost
    mid-stream. The task still counts the request; honour it here."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def _for_role(message: ProcessedRequest, role: str) -> bool:
    return 0 <= message.hop_index < len(message.route) and message.hop == role


def _refs(message: ProcessedRequest) -> list[TensorRef]:
    return [held.ref for held in (message.decoded, message.encoded, message.kv) if held is not None]


def _trace(role: str, trace: dict[str, float]) -> None:
    """The request's numbers for this hop: one log line, and the metrics."""
    for direction in ("put", "get"):
        nbytes, seconds = trace.get(f"{direction}_bytes"), trace.get(f"{direction}_s")
        if nbytes is None or seconds is None:
            continue
        metrics.HOP_TENSOR_BYTES.labels(role, direction).inc(nbytes)
        metrics.HOP_TRANSFER_SECONDS.labels(role, direction).observe(seconds)
        if seconds > 0:
            trace[f"{direction}_gbps"] = nbytes / seconds / 1e9
            metrics.HOP_TRANSFER_GBPS.labels(role, direction).observe(trace[f"{direction}_gbps"])
    if trace:
        log.info("hop_trace", role=role, **{k: round(v, 6) for k, v in trace.items()})


class _TokenLatency:
    """TTFT, inter-token latency and request time as the decoding worker sees
    them when it publishes (the bridge adds only its relay on top). A request
    taken over after a crash does not count its first chunk as a first token."""

    def __init__(self, role: str, created: float) -> None:
        self.role = role
        self.created = created
        self.last: float | None = None

    def chunk(self, chunk: TokenChunk) -> None:
        now = time.time()
        if self.last is not None:
            metrics.ITL.labels(self.role).observe(now - self.last)
        elif chunk.seq == 0 and self.created:
            metrics.TTFT.labels(self.role).observe(max(0.0, now - self.created))
        if chunk.finish_reason is not None and self.created:
            metrics.E2E.labels(self.role).observe(max(0.0, now - self.created))
        self.last = now


class Worker:
    def __init__(
        self,
        nc: Client,
        js: JetStreamContext,
        config: PipelineConfig,
        stage: Stage,
        max_inflight: int = 4,
        worker_id: str | None = None,
        drain_grace_s: float = 30.0,
        tensors: TensorTransport | None = None,
        kv_events_endpoint: str = "",
        canary: CanarySettings | None = None,
        freeze_heap: bool = False,
    ) -> None:
        self.nc = nc
        self.js = js
        self.config = config
        self.stage = stage
        self.role = stage.role
        self.consumer = config.consumer_for(self.role)
        self.subjects = config.subjects
        self.max_inflight = max_inflight
        self.worker_id = check_token(worker_id or f"{role_token(self.role)}-{uuid.uuid4().hex[:8]}", "worker id")
        self.drain_grace_s = drain_grace_s
        # The process's startup heap frozen (pipeline/gc_heap.py) once the
        # stage has started, before the first fetch: the collection before
        # the freeze holds the GIL for seconds where the heap is large
        # (SGLang's: 3 s on two cores), and a message fetched meanwhile
        # waited for it past a short ack wait, to be redelivered to another
        # worker while this one still ran it.
        self.freeze_heap = freeze_heap
        self.tensors = tensors
        # Where the engine publishes its KV events when the stage does not say
        # (its engine in a process of its own, or vLLM's): relayed on NATS.
        self.kv_events_endpoint = kv_events_endpoint
        self.replies = ReplyPublisher(nc, js, self.subjects)
        self.settler = Settler(js, self.replies, self.subjects, self.role)
        self.cancels = CancelRegistry()
        self._decoder: Decoder[GenerateRequest | ProcessedRequest] = Decoder(stage.input_type)
        self._tasks: set[asyncio.Task[None]] = set()
        self._slot_free = asyncio.Event()
        self._stopping = asyncio.Event()
        self._draining: set[asyncio.Task[None]] = set()
        # --router kv: what a router sent this hop worker, and what it tells routers.
        routed = config.router.kv and self.role in HOP_ROLES
        self.inbox = (
            RoutedInbox(js, config, self.role, self.worker_id, max_inflight, self._has_slot, self._start)
            if routed
            else None
        )
        self.reports = WorkerReports(nc, self.subjects, self.worker_id, self._load) if routed else None
        self._announced: asyncio.Task[None] | None = None
        # Where this process sends the hops it forwards (--router kv): the
        # processor sends the first, an encode worker the one that prefills.
        self.router = KvRouter(nc, js, config) if config.router.kv and self.role in _ROUTING_ROLES else None
        self.ready = asyncio.Event()
        # Messages taken from the queue, whatever their outcome.
        self.handled = 0
        # When the fetch loop last turned or a request last produced output
        # (monotonic; None until the loop starts): what liveness is judged on.
        self.last_progress: float | None = None
        # When it last started or finished a message: the canary runs once it has been idle long enough.
        self._last_busy = time.monotonic()
        # Sleep mode: the level the stage sleeps at (0: awake); ``_resting``
        # from the moment one is asked for until it is awake again (no fetching).
        self.sleeping = 0
        self._resting = False
        self._sleep_lock = asyncio.Lock()
        probe = getattr(stage, "canary", None)
        self.canary = (
            Canary(canary, self.role, probe, self._idle_s)
            if canary is not None and canary.interval_s > 0 and probe is not None
            else None
        )

    # -- lifecycle -----------------------------------------------------------

    async def run(self) -> None:
        """Serve until ``stop()``; then drain: finish in-flight work within the
        grace period and give back what cannot finish."""
        await ensure_streams(self.js, self.config)
        await ensure_consumer(self.js, self.config, self.role)
        await self.stage.start()
        await self.cancels.listen(self.nc, self.subjects, also=self._release_held)
        ping = await self.nc.subscribe(self.subjects.ping(self.role), cb=self._on_ping)
        resets = await self.nc.subscribe(self.subjects.cache_reset, cb=self._on_cache_reset)
        sleeps = await self.nc.subscribe(self.subjects.sleep(self.role), cb=self._on_sleep)
        loras = await self._open_loras()
        lora_commands = await self.nc.subscribe(self.subjects.lora(self.role), cb=self._on_lora)
        psub = await self.js.pull_subscribe_bind(self.subjects.durable(self.role), self.subjects.stream(self.role))
        background = []
        relay = self._relay()
        if self.inbox is not None and self.reports is not None:
            self._tell_embeddings(self.reports)
            await self.inbox.open()
            background = [asyncio.create_task(self.inbox.run(self._stopping)), asyncio.create_task(self.reports.run())]
        if self.router is not None:
            await self.router.start()
        if self.canary is not None:
            background.append(asyncio.create_task(self.canary.run(self._stopping)))
        if self.freeze_heap:
            freeze_startup_heap()
        log.info("worker_started", role=self.role, worker_id=self.worker_id, max_inflight=self.max_inflight)
        self.ready.set()
        try:
            await self._fetch_loop(psub)
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await self._drain()
            if self.inbox is not None:
                await self.inbox.give_back()
            if relay is not None:
                await relay.close()
            if self.router is not None:
                await self.router.close()
            await ping.unsubscribe()
            await resets.unsubscribe()
            await sleeps.unsubscribe()
            await lora_commands.unsubscribe()
            if loras is not None:
                await loras.close()
            await psub.unsubscribe()
            await self.cancels.close()
            await self.stage.close()
            log.info("worker_stopped", role=self.role, worker_id=self.worker_id)

    async def _release_held(self, request_id: str) -> None:
        # Nobody will read what a cancelled request left here: free it now, not at its TTL.
        if self.tensors is not None and (regions := await self.tensors.release_owner(request_id)):
            log.info("tensors_released_on_cancel", role=self.role, request_id=request_id, regions=regions)

    def stop(self) -> None:
        self._stopping.set()
        self._slot_free.set()
        if self.reports is not None:
            # Routers hear it at once, not when the worker falls silent.
            with contextlib.suppress(RuntimeError):  # no loop: nobody routes to it yet
                self._announced = asyncio.get_running_loop().create_task(self.reports.publish_load(draining=True))

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def _progressed(self) -> None:
        self.last_progress = time.monotonic()

    @property
    def healthy(self) -> bool:
        """False while its last canary health check failed: it takes no work then."""
        return self.canary is None or self.canary.healthy

    @property
    def resting(self) -> bool:
        """Asleep, or on its way to sleep: it fetches nothing."""
        return self._resting

    def _idle_s(self) -> float:
        # Asleep, or on the way: no canary either.
        return 0.0 if self._tasks or self._resting else time.monotonic() - self._last_busy

    async def _fetch_loop(self, psub: Any) -> None:
        while not self._stopping.is_set():
            self._progressed()
            if len(self._tasks) >= self.max_inflight:
                self._slot_free.clear()
                await self._slot_free.wait()
                continue
            if not self.healthy:
                # Its canary failed: nothing more for this engine until one passes.
                metrics.BACKPRESSURE.labels(self.role, "unhealthy").inc()
                await asyncio.sleep(0.1)
                continue
            if self._resting:
                await asyncio.sleep(0.1)  # asleep (sleep mode): nothing until it wakes
                continue
            if not self.stage.has_room():
                # The engine's memory for sequences (its KV blocks) is spent:
                # more would only wait inside. Running ones leaving make room.
                metrics.BACKPRESSURE.labels(self.role, "engine_full").inc()
                await asyncio.sleep(0.05)
                continue
            if self.tensors is not None and not self.tensors.has_room():
                # Held tensors at their byte budget: taking more work would
                # only hold more. Readers (or the TTL) free room.
                metrics.BACKPRESSURE.labels(self.role, "tensor_budget").inc()
                await asyncio.sleep(0.05)
                continue
            try:
                # One message per fetch: a multi-message fetch that comes back
                # short waits out its whole timeout, which would add latency.
                # Only ever as many as there are free slots.
                msgs = await psub.fetch(1, timeout=1.0)
            except (TimeoutError, NatsTimeoutError):
                continue
            except Exception as exc:  # the connection is down; nats-py reconnects
                if self._stopping.is_set():
                    break
                log.warning("fetch_failed", role=self.role, error=repr(exc))
                await asyncio.sleep(0.5)
                continue
            if self._stopping.is_set():
                # Stopped while the fetch was out: not ours to start any more.
                await self._give_back(msgs)
                break
            for msg in msgs:
                self._start(msg)

    def _start(self, msg: Msg) -> None:
        self._last_busy = time.monotonic()
        task = asyncio.create_task(self._handle(msg))
        if self.reports is not None:
            self.reports.changed()
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        metrics.INFLIGHT.labels(self.role).set(len(self._tasks))

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._progressed()
        self._last_busy = time.monotonic()
        self._tasks.discard(task)
        if self.reports is not None:
            self.reports.changed()
        # What was sent to this worker, for its cache, goes before the shared queue.
        if self.inbox is not None and not self._stopping.is_set() and (msg := self.inbox.next_waiting()):
            self._start(msg)
        metrics.INFLIGHT.labels(self.role).set(len(self._tasks))
        self._slot_free.set()

    def _has_slot(self) -> bool:
        return (
            len(self._tasks) < self.max_inflight
            and self.healthy
            and not self._resting
            and self.stage.has_room()
            and (self.tensors is None or self.tensors.has_room())
        )

    # -- --router kv: the worker's own subject, what it tells routers ------------

    def _load(self, draining: bool = False) -> WorkerLoad:
        usage = getattr(self.stage, "kv_usage", None)
        active, total = usage() if usage is not None else (0, 0)
        return WorkerLoad(
            self.role,
            self.worker_id,
            inflight=len(self._tasks),
            max_inflight=self.max_inflight,
            waiting=len(self.inbox.waiting) if self.inbox is not None else 0,
            active_blocks=active,
            total_blocks=total,
            draining=draining or self._stopping.is_set(),
            takes_cached_media=bool(getattr(self.stage, "takes_cached_media", False)),
        )

    def _tell_embeddings(self, reports: WorkerReports) -> None:
        encoder = getattr(getattr(self.stage, "engine", None), "encoder", None)
        if encoder is not None and getattr(encoder, "cache", None) is not None:
            encoder.on_cached = reports.embeddings_changed

    def _kv_events_endpoint(self) -> str:
        return getattr(getattr(self.stage, "engine", None), "kv_events_endpoint", "") or self.kv_events_endpoint

    def _relay(self) -> KvEventRelay | None:
        endpoint = self._kv_events_endpoint()
        if not endpoint:
            return None
        # An engine whose block hashes are not mmpipe's keys (vLLM's) rewrites its batches.
        keys = getattr(getattr(self.stage, "engine", None), "block_keys", None)
        rewrite = keys.rewrite if keys is not None else None
        relay = KvEventRelay(self.nc, endpoint, self.subjects.kv_events(self.worker_id), rewrite=rewrite)
        return relay if relay.start() else None

    async def _give_back(self, msgs: list[Msg]) -> None:
        for msg in msgs:
            try:
                await msg.nak(delay=0)
            except Exception as exc:  # not lost: redelivered after ack_wait
                log.warning("give_back_failed", role=self.role, error=repr(exc))

    async def _drain(self) -> None:
        """Finish what is in flight within the grace period; nak (no delay)
        what cannot finish, so another worker takes it at once (a decode
        resumes after the chunks this one stored); then wait, in what is left
        of the grace, for readers to take the tensors this worker holds
        (closing the transport frees whatever they did not)."""
        deadline = time.monotonic() + self.drain_grace_s
        await self._hand_back(deadline)
        if self.tensors is not None:
            await self._tensors_read(self.tensors, deadline)

    async def _hand_back(self, deadline: float) -> None:
        """What is in flight finishes by ``deadline``; the rest is naked (no
        delay) for another worker of the role."""
        if self._tasks:
            grace = max(deadline - time.monotonic(), 0.0)
            log.info("worker_draining", role=self.role, inflight=len(self._tasks), grace_s=round(grace, 3))
            _, pending = await asyncio.wait(set(self._tasks), timeout=grace)
            for task in pending:
                # Marked so the handler naks (hands the message to another worker
                # at once) instead of treating it as a client cancel.
                self._draining.add(task)
                task.cancel()
            if pending:
                await asyncio.wait(pending)
                log.info("worker_handed_back", role=self.role, requests=len(pending))

    async def _tensors_read(self, tensors: TensorTransport, deadline: float) -> None:
        for _ in range(max(0, int((deadline - time.monotonic()) / 0.05))):
            if not tensors.held_bytes:
                return
            await asyncio.sleep(0.05)
        if tensors.held_bytes:
            log.warning("tensors_unread_at_exit", role=self.role, bytes=tensors.held_bytes)

    async def _on_ping(self, msg: Msg) -> None:
        info = WorkerInfo(
            role=self.role,
            worker_id=self.worker_id,
            models=self.stage.models,
            inflight=len(self._tasks),
            max_inflight=self.max_inflight,
            kv_events_endpoint=self._kv_events_endpoint(),
            healthy=self.healthy,
            problem=self.canary.problem if self.canary is not None else "",
            sleeping=self.sleeping or (-1 if self._resting else 0),
        )
        await msg.respond(encode(info))

    # -- sleep mode (vLLM's /sleep, /wake_up) -----------------------------------

    async def sleep(self, level: int) -> SleepState:
        """Lend the device's memory back: stop fetching, let what is in
        flight finish within the drain grace (the rest goes back to the
        queue for another worker, a stream resuming there after the chunks
        stored), then the stage's sleep at ``level`` (1: KV cache freed,
        weights to host memory; 2: weights dropped too)."""
        sleep = getattr(self.stage, "sleep", None)
        if sleep is None:
            return SleepState(self.role, self.worker_id, supported=False)
        if level not in (1, 2):
            return SleepState(self.role, self.worker_id, self.sleeping, error=f"sleep level {level}: 1 or 2")
        async with self._sleep_lock:
            if self.sleeping:
                return SleepState(self.role, self.worker_id, self.sleeping, held=self._held())
            self._resting = True
            log.info("worker_going_to_sleep", role=self.role, level=level, inflight=len(self._tasks))
            await self._hand_back(time.monotonic() + self.drain_grace_s)
            try:
                held_before = await sleep(level)
            except Exception as exc:
                self._resting = False
                metrics.ERRORS.labels(self.role, "sleep_failed").inc()
                log.error("sleep_failed", role=self.role, level=level, error=repr(exc))
                return SleepState(self.role, self.worker_id, error=repr(exc))
            self.sleeping = level
            log.info("worker_asleep", role=self.role, level=level)
            return SleepState(self.role, self.worker_id, level, held_before=held_before, held=self._held())

    async def wake_up(self) -> SleepState:
        """Back from ``sleep``: the stage reloads, the worker fetches again."""
        wake_up = getattr(self.stage, "wake_up", None)
        if wake_up is None:
            return SleepState(self.role, self.worker_id, supported=False)
        async with self._sleep_lock:
            if self.sleeping:
                try:
                    await wake_up()
                except Exception as exc:
                    metrics.ERRORS.labels(self.role, "wake_up_failed").inc()
                    log.error("wake_up_failed", role=self.role, error=repr(exc))
                    return SleepState(self.role, self.worker_id, self.sleeping, error=repr(exc))
                self.sleeping = 0
                log.info("worker_awake", role=self.role)
            self._resting = False
            self._slot_free.set()
            return SleepState(self.role, self.worker_id, held=self._held())

    # -- LoRA adapters (vLLM's /v1/load_lora_adapter) ---------------------------

    async def _open_loras(self) -> LoraRegistry | None:
        """The adapters bucket, where the stage runs the language model (it
        loads every adapter served, now and as they come) or processes
        requests (it accepts their names as models)."""
        takes = getattr(self.stage, "load_lora", None) is not None
        if not takes and not hasattr(self.stage, "adapters"):
            return None
        registry = LoraRegistry(self.js, self.subjects, self.config.replicas or 1)
        await registry.open()
        if hasattr(self.stage, "adapters"):
            self.stage.adapters = registry.adapters
        if takes:
            for name, path in list(registry.adapters.items()):
                await self._load_lora(name, path)
            registry.on_change = self._lora_changed
        return registry

    async def _lora_changed(self, name: str, path: str | None) -> None:
        await (self._unload_lora(name) if path is None else self._load_lora(name, path))

    async def _load_lora(self, name: str, path: str) -> str:
        """Load an adapter (again: a no-op); what went wrong, or ""."""
        try:
            await self.stage.load_lora(name, path)  # type: ignore[attr-defined]
        except Exception as exc:
            metrics.ERRORS.labels(self.role, "lora_load_failed").inc()
            log.error("lora_load_failed", role=self.role, adapter=name, path=path, error=str(exc))
            return str(exc)
        return ""

    async def _unload_lora(self, name: str) -> str:
        try:
            await self.stage.unload_lora(name)  # type: ignore[attr-defined]
        except Exception as exc:
            metrics.ERRORS.labels(self.role, "lora_unload_failed").inc()
            log.error("lora_unload_failed", role=self.role, adapter=name, error=str(exc))
            return str(exc)
        return ""

    async def _on_lora(self, msg: Msg) -> None:
        try:
            command = _LORA.decode(msg.data)
        except Exception as exc:
            await msg.respond(encode(LoraState(self.role, self.worker_id, error=f"a bad LoRA command: {exc}")))
            return
        names = getattr(self.stage, "adapters", None)
        if isinstance(names, dict):
            # A processor: it takes the name as a model from now on (or no longer).
            if command.path:
                names[command.name] = command.path
            else:
                names.pop(command.name, None)
            await msg.respond(encode(LoraState(self.role, self.worker_id, adapters=sorted(names))))
            return
        if getattr(self.stage, "load_lora", None) is None:
            await msg.respond(encode(LoraState(self.role, self.worker_id, supported=False)))
            return
        error = await (self._load_lora(command.name, command.path) if command.path else self._unload_lora(command.name))
        adapters = self.stage.loras()  # type: ignore[attr-defined]
        await msg.respond(encode(LoraState(self.role, self.worker_id, adapters=adapters, error=error)))

    def _held(self) -> dict[str, int]:
        held = getattr(self.stage, "held_bytes", None)
        return held() if held is not None else {}

    async def _on_sleep(self, msg: Msg) -> None:
        try:
            level = _SLEEP.decode(msg.data).level
        except Exception as exc:
            await msg.respond(encode(SleepState(self.role, self.worker_id, error=f"a bad sleep request: {exc}")))
            return
        state = await (self.sleep(level) if level else self.wake_up())
        await msg.respond(encode(state))

    async def reset_prefix_cache(self) -> CacheCleared:
        """Forget the stage's cached prefixes (``POST /v1/cache/reset`` on the
        bridge, or this worker's health port)."""
        reset = getattr(self.stage, "reset_prefix_cache", None)
        try:
            blocks = await reset() if reset is not None else None
        except Exception as exc:
            metrics.ERRORS.labels(self.role, "cache_reset_failed").inc()
            log.error("cache_reset_failed", role=self.role, error=repr(exc))
            return CacheCleared(self.role, self.worker_id, error=repr(exc))
        if blocks is None:
            return CacheCleared(self.role, self.worker_id, supported=False)
        return CacheCleared(self.role, self.worker_id, blocks=blocks)

    async def _on_cache_reset(self, msg: Msg) -> None:
        await msg.respond(encode(await self.reset_prefix_cache()))

    # -- one message ---------------------------------------------------------

    async def _handle(self, msg: Msg) -> None:
        with tracing.hop_span(self.role, msg.headers, worker=self.worker_id) as span:
            await self._handle_traced(msg, span)

    async def _handle_traced(self, msg: Msg, span: Span) -> None:
        self.handled += 1
        started = time.monotonic()
        meta = msg.metadata
        deliveries = meta.num_delivered or 1
        ctx = HopContext()
        if meta.timestamp:
            now_ns = time.time_ns()
            queued_ns = int(meta.timestamp.timestamp() * 1e9)
            ctx.trace["queue_wait_s"] = max(0.0, (now_ns - queued_ns) / 1e9)
            metrics.QUEUE_WAIT.labels(self.role).observe(ctx.trace["queue_wait_s"])
            tracing.past_span("queue_wait", min(queued_ns, now_ns), now_ns, role=self.role)
        content_type = (msg.headers or {}).get(CONTENT_TYPE)
        try:
            message = self._decoder.decode(msg.data, content_type)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            await self.settler.settle(msg, None, Reject(InvalidRequest(f"malformed message: {exc}")), deliveries)
            return
        request = message.request if isinstance(message, ProcessedRequest) else message
        span.set_attribute("request_id", request.request_id)
        span.set_attribute("delivery", deliveries)
        structlog.contextvars.bind_contextvars(request_id=request.request_id, stage=self.role)
        try:
            if isinstance(message, ProcessedRequest) and not _for_role(message, self.role):
                outcome: Outcome = Reject(InvalidRequest(f"a message for hop {message.hop_index} reached {self.role}"))
            else:
                outcome = await self._run_stage(msg, message, request, deliveries, ctx)
            await self.settler.settle(msg, message, outcome, deliveries)
        finally:
            metrics.STAGE_TIME.labels(self.role).observe(time.monotonic() - started)
            structlog.contextvars.unbind_contextvars("request_id", "stage")

    async def _run_stage(
        self,
        msg: Msg,
        message: GenerateRequest | ProcessedRequest,
        request: GenerateRequest,
        deliveries: int,
        ctx: HopContext,
    ) -> Outcome:
        task = asyncio.current_task()
        assert task is not None
        rid = request.request_id
        try:
            check_token(rid, "request_id")
        except ValueError as exc:
            return Reject(InvalidRequest(str(exc)))
        if self.cancels.is_cancelled(rid):
            return Ack()
        if request.deadline and time.time() >= request.deadline:
            return Reject(DeadlineExceeded("the request's deadline passed before work on it started"))
        self.cancels.register(rid, task)
        heartbeat = asyncio.create_task(self._heartbeat(msg))
        deadline = asyncio.timeout(request.deadline - time.time() if request.deadline else None)
        try:
            async with deadline:
                await self._produce(message, request, ctx, deliveries)
            return Ack()
        except TimeoutError as exc:
            if not deadline.expired():
                # nats-py's timeouts are TimeoutErrors too: a publish that got
                # no answer (a NATS node lost, a leader being elected) is
                # worth another try, not the request's end.
                late = TransientError(f"{self.role}: NATS did not answer in time ({type(exc).__name__})")
                return outcome_for(late, deliveries, self.consumer.max_deliver)
            return Reject(DeadlineExceeded("the request's deadline passed"))
        except asyncio.CancelledError:
            if task in self._draining:
                self._draining.discard(task)
                return Nak(TransientError("worker shutting down"), 0.0)
            if self.cancels.is_cancelled(rid):
                # The cancel is this request's, not the worker's: done with it.
                log.info("request_aborted", role=self.role)
                return Ack()
            raise
        except TensorGone as exc:
            return await self._restart(message, exc, deliveries)
        except MmpipeError as exc:
            return outcome_for(exc, deliveries, self.consumer.max_deliver)
        except Exception as exc:
            log.exception("stage_failed", role=self.role, error=repr(exc))
            error = InternalError(f"{self.role} failed: {type(exc).__name__}: {exc}")
            return outcome_for(error, deliveries, self.consumer.max_deliver)
        finally:
            heartbeat.cancel()
            self.cancels.unregister(rid)

    async def _restart(self, message: GenerateRequest | ProcessedRequest, exc: TensorGone, deliveries: int) -> Outcome:
        """What an earlier hop made is gone (its holder died, or it expired):
        run the request again from its first hop. Every message carries the
        processed request, so nothing but compute is lost."""
        if not isinstance(message, ProcessedRequest):
            return outcome_for(exc, deliveries, self.consumer.max_deliver)
        if message.attempt + 1 >= self.config.max_attempts:
            return Reject(TensorGone(f"{exc.message}; gave up after {message.attempt + 1} attempts"))
        if message.media_dropped:
            return await self._restart_at_bridge(message, exc, deliveries)
        again = message.restarted()
        log.warning("restarting_from_first_hop", role=self.role, error=exc.message, attempt=again.attempt)
        try:
            await self._forward(again)
        except MmpipeError as error:
            # Not queued: the redelivery finds the tensors gone again and
            # asks for this same attempt, which the first hop's stream takes
            # once (its Nats-Msg-Id).
            return outcome_for(error, deliveries, self.consumer.max_deliver)
        metrics.RESTARTS.labels(self.role).inc()
        return Ack()

    async def _restart_at_bridge(self, message: ProcessedRequest, exc: TensorGone, deliveries: int) -> Outcome:
        """A restart of a message that no longer carries its media: the
        bridge holding the request as it arrived queues it again. No bridge
        answering means no client waits for it any more."""
        rid, attempt = message.request.request_id, message.attempt + 1
        try:
            await self.nc.request(
                self.subjects.restart(rid),
                encode(Restart(request_id=rid, attempt=attempt)),
                timeout=self.config.restart_timeout_s,
            )
        except NoRespondersError:
            return Reject(TensorGone(f"{exc.message}; the bridge holding the request's media is gone"))
        except (NatsTimeoutError, TimeoutError):
            late = TransientError(f"{self.role}: the bridge did not take the restart in time")
            return outcome_for(late, deliveries, self.consumer.max_deliver)
        log.warning("restarted_at_bridge", role=self.role, error=exc.message, attempt=attempt)
        metrics.RESTARTS.labels(self.role).inc()
        return Ack()

    async def _produce(
        self, message: GenerateRequest | ProcessedRequest, request: GenerateRequest, ctx: HopContext, deliveries: int
    ) -> None:
        reply_subject = request.reply_subject or self.subjects.reply(request.request_id)
        # Only a request run before (this hop redelivered, an earlier hop of
        # this attempt redelivered, or a new attempt) can have emitted chunks:
        # a first run skips reading the reply stream, a round trip before the
        # first token.
        redelivered = deliveries > 1 or (isinstance(message, ProcessedRequest) and message.redelivered)
        taken_over = redelivered or (isinstance(message, ProcessedRequest) and message.attempt > 0)
        ctx.redelivered = deliveries > 1
        if isinstance(message, ProcessedRequest) and self.stage.resumes_stream:
            # What an earlier hop of this run streamed (its prefill's token);
            # the reply stream, read below on a takeover, can only hold more.
            ctx.emitted = list(message.emitted)
        if taken_over and self.stage.resumes_stream and self.replies.is_stored(request.request_id, reply_subject):
            with ctx.timed("read_emitted"):
                emitted = await self.replies.read_emitted(request.request_id)
            if emitted.finished:
                log.info("already_finished", role=self.role)
                return
            ctx.emitted = emitted.token_ids
        # aclosing: a cancel that lands while we await a publish must still
        # run the stage's cleanup (free its sequence), not leave it suspended.
        latency = _TokenLatency(self.role, request.created)
        async with contextlib.aclosing(self.stage.run(message, ctx)) as outputs:
            async for out in outputs:
                self._progressed()
                if isinstance(out, ProcessedRequest):
                    if redelivered:
                        out = msgspec.structs.replace(out, redelivered=True)
                    out = _lighter(out)
                    with ctx.timed("forward"):
                        await self._forward_holding(out)
                else:
                    await self._reply(reply_subject, out, first=latency.last is None, ctx=ctx)
                    if isinstance(out, TokenChunk):
                        metrics.TOKENS.labels(self.role).inc(len(out.token_ids))
                        latency.chunk(out)
                _raise_if_cancelled()

        _trace(self.role, ctx.trace)

    async def _reply(self, subject: str, chunk: ReplyChunk, first: bool, ctx: HopContext) -> None:
        give_up = time.monotonic() + self.config.unavailable_wait_s
        if not first:
            await self._until_stored(lambda: self.replies.publish(subject, chunk), give_up)
            return
        with ctx.timed("first_reply"):
            await self._until_stored(lambda: self.replies.publish(subject, chunk), give_up)

    async def _forward_holding(self, out: ProcessedRequest) -> None:
        """Forward; if the next hop never gets the message, nobody will read
        the tensors it refers to: free them now rather than at their TTL."""
        try:
            await self._forward(out)
        except BaseException:
            for ref in _refs(out):
                if self.tensors is not None:
                    await self.tensors.release(ref)
            raise

    async def _forward(self, out: ProcessedRequest) -> None:
        subject, out = self.router.place(out) if self.router is not None else (self.subjects.work(out.hop), out)
        headers = {
            CONTENT_TYPE: MSGPACK,
            # A retried publish of this hop is dropped by the stream; a new
            # attempt from the first hop is not.
            "Nats-Msg-Id": f"{out.request.request_id}:{out.attempt}:{out.hop_index}",
        }
        tracing.inject(headers)
        data = encode(out)
        limit = self.nc.max_payload - _HEADER_ROOM
        if len(data) > limit:
            # No retry makes it smaller: refuse it (413) rather than nak it max_deliver times.
            raise TooLarge(f"the request is {len(data)} bytes as a message for {out.hop}; the limit is {limit} bytes")
        # Back-pressure: while the next hop's queue is full, hold the message
        # (heartbeats keep it ours, and the slot it takes keeps this worker
        # from fetching more, so the queue before it fills up to the bridge's
        # 429) until the request's deadline ends the wait. Handing it back
        # sooner would spend one of its max_deliver deliveries on load that
        # is not its fault. Only a request with no deadline gives up, after
        # full_stream_wait_s.
        full_until = None if out.request.deadline else time.monotonic() + self.config.full_stream_wait_s
        unavailable_until = time.monotonic() + self.config.unavailable_wait_s
        pause = 0.05
        while True:
            try:
                await self._until_stored(lambda: self.js.publish(subject, data, headers=headers), unavailable_until)
                return
            except MaxPayloadError:
                raise TooLarge(f"the request is too large for a message to {out.hop}") from None
            except APIError as exc:
                if not is_stream_full(exc) or (full_until is not None and time.monotonic() >= full_until):
                    raise TransientError(f"could not queue for {out.hop}: {exc.description}") from exc
            except Exception as exc:
                if not is_not_now(exc):
                    raise
                raise TransientError(f"could not queue for {out.hop}: JetStream did not answer ({exc!r})") from exc
            metrics.BACKPRESSURE.labels(self.role, "next_hop_full").inc()
            await asyncio.sleep(pause)
            pause = min(2 * pause, 0.5)

    async def _until_stored(self, publish: Callable[[], Awaitable[object]], give_up: float) -> None:
        """``publish`` to a stream, tried again while no stream answers for
        now (a NATS node lost, its streams electing leaders) until
        ``give_up``. Given up on at once, the hop's work would be lost with
        what it consumed: its input tensors are read once, so the message's
        redelivery would find them gone and restart the request from its
        first hop, spending one of its attempts on the outage. (The
        JetStream context's own retry of no responders spans a second: a
        new stream being heard of, not a leader elected.) Every publish here
        carries a Nats-Msg-Id: one that was stored though its answer was
        lost is stored once."""
        pause = 0.05
        while True:
            try:
                await publish()
                return
            except Exception as exc:
                if not is_not_now(exc) or self.nc.is_closed or time.monotonic() >= give_up:
                    raise
                log.info("jetstream_unavailable", role=self.role, error=repr(exc), retry_in_s=pause)
            # nats-py may swallow a cancel (a deadline, a drain) inside the publish.
            _raise_if_cancelled()
            metrics.BACKPRESSURE.labels(self.role, "jetstream_unavailable").inc()
            await asyncio.sleep(pause)
            pause = min(2 * pause, 1.0)

    async def _heartbeat(self, msg: Msg) -> None:
        # A third of ack_wait keeps a long generation from being redelivered.
        interval = self.consumer.ack_wait_s / 3
        while True:
            await asyncio.sleep(interval)
            try:
                await msg.in_progress()
            except Exception as exc:  # reconnecting: the next beat may get through
                log.warning("heartbeat_failed", role=self.role, error=repr(exc))


def _lighter(out: ProcessedRequest) -> ProcessedRequest:
    """A message past its media's encoding, of a request its bridge can
    restart, goes on without the inline media bytes."""
    if not out.bridge_restarts or out.media_dropped or not out.media:
        return out
    encoded = out.encoded if out.encoded is not None else out.vllm_encoded
    if encoded is None or len(encoded.items) != len(out.media):
        return out
    return out.without_inline_media()
