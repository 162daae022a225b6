"""The built-in engine run in its own process (``--engine-process``), as a
hop sees it: ``ProcessHopEngine`` starts the engine core
(stages/torch_engine/core_process.py) and forwards each of the hop's steps
to it as one message.

The worker keeps NATS, the chunks and their text; the core keeps the model,
the KV pool, the decode loop and media decoding. A sequence and a request's
embeddings stay in the core: the worker holds their numbers (and the
embeddings' sizes, which the context check reads). The engine's
operations beside serving (LoRA adapters, sleep and wake, the canary) are
one message each too, answered with the engine's state after them.

Only roles that hand no tensors to another hop run this way so far (EPD):
a split role's NIXL agent would have to live beside the tensors, in the core.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import shutil
import tempfile
import weakref
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import structlog
import torch
from opentelemetry.trace import Span

import schemas.errors
from schemas.errors import InvalidRequest, MmpipeError
from schemas.processed import MediaKind, ProcessedRequest
from schemas.routes import moves_tensors
from stages.contract import HopContext, replay_steps, step_span
from stages.families import MediaEmbedding
from stages.hop_engine import Carried, client_ahead
from stages.sampling import Logprobs
from stages.torch_engine import core_process
from stages.torch_engine.core_wire import (
    Abort,
    Broken,
    CacheReset,
    Canary,
    Cancel,
    Decode,
    Done,
    DropMedia,
    Encode,
    Encoded,
    Failed,
    Finished,
    FromCore,
    LoadLora,
    Operation,
    Prefill,
    Prefilled,
    Ready,
    ResetCache,
    Room,
    Scrape,
    Scraped,
    Sleep,
    StartFailed,
    ToCore,
    Tokens,
    UnloadLora,
    WakeUp,
    frame,
    read_frame,
)

log = structlog.get_logger(__name__)

_END = object()
# How often start() looks whether the core process is still alive while it loads.
_START_POLL_S = 0.2
# How long close() gives the core to free what it holds and exit before it is killed.
_EXIT_S = 30.0


class EngineCoreDied(MmpipeError):
    """The engine core process is gone: nothing it held can be served here."""

    retryable = True


@dataclass(eq=False)
class RemoteEmbedding(MediaEmbedding):
    """An item's embeddings as the core holds them: the worker sees their
    size (a tensor on the meta device, no memory) and the core's number."""

    media: int = 0


@dataclass(eq=False)
class RemotePrefilled:
    seq: int
    prompt_len: int
    output_ids: list[int] = field(default_factory=list)
    aborted: bool = False
    cached_tokens: int = 0
    # Where asked: its tokens' logprobs by index among the generated tokens, and its prompt's.
    logprobs: dict[int, Logprobs] = field(default_factory=dict)
    prompt_logprobs: list[Logprobs] | None = None


class ProcessHopEngine:
    def __init__(self, role: str, build: Callable[[], Any], model_dir: Path) -> None:
        """``build``: a picklable callable that builds the ``TorchHopEngine``
        of ``role`` in the core (it loads the model there)."""
        if moves_tensors(role):
            raise ValueError(
                f"role {role} hands tensors to or from another hop: --engine-process runs roles that hand none off"
            )
        from transformers import AutoTokenizer

        self.role = role
        self._build = build
        # The chunks' text is made here: the worker needs the tokenizer, not the model.
        self.tokenizer: Any = AutoTokenizer.from_pretrained(str(model_dir))
        self._ready: Ready | None = None
        self._process: Any = None
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task[None] | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromCore)
        self._ids = itertools.count(1)
        self._replies: dict[int, asyncio.Future[Any]] = {}
        self._streams: dict[int, asyncio.Queue[Any]] = {}
        self._room = True
        self._gone: str | None = None
        self._broken: str | None = None
        self._eos: frozenset[int] = frozenset()
        # The core's engine as its last answer told it: device bytes held, adapters loaded.
        self._held: dict[str, int] = {}
        self._loras: list[str] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- what the chunks and the context check read -------------------------------

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    @property
    def max_model_len(self) -> int:
        if self._ready is None:
            raise RuntimeError("the engine core has not started")
        return self._ready.max_model_len

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    # -- life ----------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        folder = Path(tempfile.mkdtemp(prefix="mmpipe-core-"))
        connected: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = (
            asyncio.get_running_loop().create_future()
        )

        def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if connected.done():
                writer.close()
            else:
                connected.set_result((reader, writer))

        server = await asyncio.start_unix_server(accept, str(folder / "core.sock"))
        try:
            # Spawned: the core holds CUDA state, and a fork of a threaded worker copies half its locks.
            self._process = multiprocessing.get_context("spawn").Process(
                target=core_process.main, args=(str(folder / "core.sock"), self._build), name="mmpipe-engine-core"
            )
            self._process.start()
            self._reader, self._writer = await self._while_alive(connected, "connecting")
            first = asyncio.ensure_future(read_frame(self._reader))
            payload = await self._while_alive(first, "loading the model")
        finally:
            server.close()
            shutil.rmtree(folder, ignore_errors=True)
        msg = self._decoder.decode(payload) if payload is not None else None
        if not isinstance(msg, Ready):
            await self.close()
            error = msg.error if isinstance(msg, StartFailed) else "it closed its socket"
            raise RuntimeError(f"the engine core did not start: {error}")
        self._ready = msg
        self._eos = frozenset(msg.eos_token_ids)
        self._held = msg.held
        self._reading = asyncio.create_task(self._read(), name="engine-core-reader")
        log.info("engine_core_started", pid=msg.pid, device=msg.device, role=self.role)

    async def _while_alive(self, waiting: asyncio.Future[Any], doing: str) -> Any:
        while True:
            done, _ = await asyncio.wait([waiting], timeout=_START_POLL_S)
            if done:
                return waiting.result()
            if not self._process.is_alive():
                waiting.cancel()
                raise RuntimeError(f"the engine core exited ({self._process.exitcode}) while {doing}")

    async def close(self) -> None:
        self._gone = self._gone or "closed"
        if self._writer is not None:
            self._writer.close()  # the core ends when its socket does
        process, self._process = self._process, None
        if process is not None:
            await asyncio.to_thread(process.join, _EXIT_S)
            if process.is_alive():
                log.warning("engine_core_killed", pid=process.pid, after_s=_EXIT_S)
                process.kill()
                await asyncio.to_thread(process.join)
        if self._reading is not None:
            self._reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reading

    async def health(self) -> None:
        if self._gone is not None:
            raise RuntimeError(f"the engine core is gone: {self._gone}")
        if self._broken is not None:
            raise RuntimeError(f"the engine core can serve no more: {self._broken}")

    def has_room(self) -> bool:
        return self._room and self._gone is None

    async def scrape(self) -> bytes:
        """The core's Prometheus exposition (its engine, pool and thread metrics)."""
        reply = await self._call(Scrape(next(self._ids)))
        assert isinstance(reply, Scraped)
        return reply.text

    async def reset_prefix_cache(self) -> int | None:
        reply = await self._call(ResetCache(next(self._ids)))
        assert isinstance(reply, CacheReset)
        return reply.blocks

    # -- the engine's operations: LoRA adapters, sleep mode, the canary --------------

    async def load_lora(self, name: str, path: str) -> None:
        """Load a LoRA adapter into the core's engine (again: nothing)."""
        await self._operate(LoadLora(next(self._ids), name, path))

    async def unload_lora(self, name: str) -> None:
        await self._operate(UnloadLora(next(self._ids), name))

    def loras(self) -> list[str]:
        return list(self._loras)

    async def sleep(self, level: int) -> dict[str, int]:
        """The core's engine asleep (``TorchHopEngine.sleep``): the bytes it held."""
        return (await self._operate(Sleep(next(self._ids), level))).result

    async def wake_up(self) -> None:
        await self._operate(WakeUp(next(self._ids)))

    def held_bytes(self) -> dict[str, int]:
        """The core's engine's device bytes as it last told them (at start and after each operation)."""
        return dict(self._held)

    async def canary(self) -> None:
        """The worker's canary health check, through the core's engine and its thread."""
        await self._operate(Canary(next(self._ids)))

    async def _operate(self, msg: Operation) -> Done:
        reply = await self._call(msg)
        assert isinstance(reply, Done)
        self._held, self._loras = reply.held, reply.loras
        return reply

    # -- the hop's steps -------------------------------------------------------------

    async def encode(self, req: ProcessedRequest, ctx: HopContext) -> list[MediaEmbedding]:
        if not req.media:
            return []
        with ctx.timed("engine_encode", items=len(req.media)):
            reply = await self._call(Encode(next(self._ids), req))
            assert isinstance(reply, Encoded)
            replay_steps(reply.steps)
        ctx.trace.update(reply.trace)
        out: list[MediaEmbedding] = [
            RemoteEmbedding(
                torch.empty((i.num_tokens, 0), device="meta"),
                tuple(i.grid),
                MediaKind(i.kind),
                i.seconds_per_grid,
                media=reply.media,
            )
            for i in reply.items
        ]
        if out:
            # A request that fails before its prefill (its context too long)
            # leaves them: the core drops them once the worker forgets them.
            weakref.finalize(out[0], self._forget_media, reply.media)
        return out

    def _forget_media(self, media: int) -> None:
        # Called where the last reference went, which may be another thread.
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._drop_media, media)
        except RuntimeError:  # the loop closed meanwhile: the core goes with it
            pass

    def _drop_media(self, media: int) -> None:
        if self._gone is None and self._writer is not None and not self._writer.is_closing():
            self._send(DropMedia(media))

    async def send_media(self, media: list[MediaEmbedding], req: ProcessedRequest, ctx: HopContext) -> Carried:
        raise InvalidRequest(f"role {self.role} in an engine process hands no media on")

    async def receive_media(self, req: ProcessedRequest, ctx: HopContext) -> list[MediaEmbedding]:
        raise InvalidRequest(f"role {self.role} in an engine process receives no media")

    async def prefill(self, req: ProcessedRequest, media: list[MediaEmbedding], ctx: HopContext) -> RemotePrefilled:
        handle = media[0].media if media and isinstance(media[0], RemoteEmbedding) else 0
        with ctx.timed("engine_prefill", tokens=len(req.prompt_token_ids)):
            reply = await self._call(Prefill(next(self._ids), req, handle, list(ctx.emitted)))
            assert isinstance(reply, Prefilled)
            replay_steps(reply.steps)
        ctx.trace.update(reply.trace)
        return RemotePrefilled(
            reply.seq,
            reply.prompt_len,
            reply.output_ids,
            cached_tokens=reply.cached_tokens,
            prompt_logprobs=reply.prompt_logprobs,
        )

    # The core sends them beside the tokens (the prompt's with the prefill's reply).
    supports_logprobs = True
    engine_flag = "--engine-process"  # named in what it refuses

    def logprobs(self, handle: RemotePrefilled, index: int) -> Logprobs | None:
        return handle.logprobs.get(index)

    def prompt_logprobs(self, handle: RemotePrefilled) -> list[Logprobs] | None:
        return handle.prompt_logprobs

    def first_token(self, handle: RemotePrefilled) -> int | None:
        return handle.output_ids[-1]

    async def hand_off(self, handle: RemotePrefilled, req: ProcessedRequest, ctx: HopContext) -> Carried:
        raise InvalidRequest(f"role {self.role} in an engine process hands no KV cache on")

    async def receive_prefilled(self, req: ProcessedRequest, ctx: HopContext) -> RemotePrefilled:
        raise InvalidRequest(f"role {self.role} in an engine process receives no KV cache")

    async def decode(
        self, handle: RemotePrefilled, req: ProcessedRequest, ctx: HopContext, is_eos: Callable[[int], bool]
    ) -> AsyncGenerator[int, None]:
        """``is_eos`` is the ChunkEmitter's rule (the engine's EOS ids unless
        ``ignore_eos``): the core applies the same rule to stop the sequence
        before a step it has no use for."""
        call = next(self._ids)
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._streams[call] = queue
        ended = False
        # The tokens the core has before any step (the prefill's, or the
        # one a takeover's resume makes); then, until the next one, the
        # first step: joining the core's batch and one step.
        before = 1 if client_ahead(handle.output_ids, ctx.emitted) else len(handle.output_ids) - len(ctx.emitted)
        received = 0
        first_step: Span | None = step_span("first_step")
        try:
            self._send(Decode(call, handle.seq, req, list(ctx.emitted)))
            while True:
                item = await queue.get()
                if item is _END:
                    ended = True
                    return
                if isinstance(item, BaseException):
                    ended = True
                    raise item
                made, logprobs = item
                if first_step is not None:
                    received += len(made)
                    if received > before:
                        first_step.end()
                        first_step = None
                if logprobs:
                    handle.logprobs.update(logprobs)  # before their tokens go to the stage, which reads them
                for token in made:
                    yield token
        finally:
            if first_step is not None:
                first_step.end()
            self._streams.pop(call, None)
            if not ended and self._gone is None:
                self._send(Cancel(call))

    async def abort(self, handle: RemotePrefilled) -> None:
        if not handle.aborted:
            handle.aborted = True
            if self._gone is None:
                self._send(Abort(handle.seq))

    # -- the socket -------------------------------------------------------------------

    async def _call(self, msg: ToCore) -> FromCore:
        if self._gone is not None:
            raise EngineCoreDied(f"the engine core is gone: {self._gone}")
        call: int = msg.call  # type: ignore[union-attr]
        reply: asyncio.Future[FromCore] = asyncio.get_running_loop().create_future()
        self._replies[call] = reply
        self._send(msg)
        try:
            return await reply
        except asyncio.CancelledError:
            if self._replies.pop(call, None) is not None:
                if self._gone is None:
                    self._send(Cancel(call))
            elif reply.done() and not reply.cancelled() and reply.exception() is None:
                # The reply came, and the caller was cancelled before it woke to take it.
                self._orphaned(reply.result())
            raise

    def _send(self, msg: ToCore) -> None:
        if self._writer is None:
            raise RuntimeError("the engine core has not started")
        self._writer.write(frame(self._encoder.encode(msg)))

    async def _read(self) -> None:
        assert self._reader is not None
        reason = "it closed its socket"
        try:
            while (payload := await read_frame(self._reader)) is not None:
                self._on(self._decoder.decode(payload))
        except asyncio.CancelledError:
            reason = "closed"
            raise
        except Exception as exc:
            reason = repr(exc)
        finally:
            self._lost(reason)

    def _on(self, msg: FromCore) -> None:
        if isinstance(msg, Tokens):
            for call, tokens in msg.streams:
                if (queue := self._streams.get(call)) is not None:
                    queue.put_nowait((tokens, msg.logprobs.get(call)))
        elif isinstance(msg, Finished):
            if (queue := self._streams.get(msg.call)) is not None:
                queue.put_nowait(_END)
        elif isinstance(msg, Room):
            self._room = msg.has_room
        elif isinstance(msg, Broken):
            self._broken = msg.reason
            log.error("engine_core_broken", reason=msg.reason)
        elif isinstance(msg, Failed):
            error = _rebuilt(msg)
            if (queue := self._streams.get(msg.call)) is not None:
                queue.put_nowait(error)
            elif (reply := self._replies.pop(msg.call, None)) is not None and not reply.done():
                reply.set_exception(error)
        elif isinstance(msg, Encoded | Prefilled | Scraped | CacheReset | Done):
            reply = self._replies.pop(msg.call, None)
            if reply is not None and not reply.done():
                reply.set_result(msg)
            else:
                self._orphaned(msg)  # its caller left while the core worked

    def _orphaned(self, msg: FromCore) -> None:
        """A reply no caller takes: what it holds in the core is freed."""
        if self._gone is not None:
            return
        if isinstance(msg, Prefilled):
            self._send(Abort(msg.seq))
        elif isinstance(msg, Encoded) and msg.media:
            self._send(DropMedia(msg.media))

    def _lost(self, reason: str) -> None:
        if self._gone is None:
            self._gone = reason
            if reason != "closed":
                log.error("engine_core_lost", reason=reason, pid=self.pid)
        error = EngineCoreDied(f"the engine core is gone: {self._gone}")
        for reply in self._replies.values():
            if not reply.done():
                reply.set_exception(error)
        self._replies.clear()
        for queue in self._streams.values():
            queue.put_nowait(error)
        self._room = False


def _rebuilt(msg: Failed) -> Exception:
    """The core's error as the worker raises it: a schemas.errors class
    keeps its code and HTTP status; any other is internal."""
    cls = getattr(schemas.errors, msg.error, None)
    if isinstance(cls, type) and issubclass(cls, MmpipeError):
        try:
            return cls(msg.message)
        except TypeError:
            pass
    return RuntimeError(f"the engine core failed: {msg.error}: {msg.message}")
