"""The engine core: the built-in engine in a process of its own
(``--engine-process``), as vLLM v1 runs its EngineCore.

Why a process: a GPU worker's engine thread and its event loop share one
GIL. On an H100 host under 64 clients (2B preset) the engine thread used
0.60 of a core and the loop 0.43, together the one core a GIL allows, and
each small torch op waited for the lock behind the loop's Python (a
same-process Python thread doubled a 1.9 ms run of small ops; another
process changed nothing). Here the model, its KV pool, the decode loop,
media decoding and the encoder run under a GIL of their own, while the
worker's loop keeps NATS, chunks and detokenizing.

The core runs a ``TorchHopEngine`` on its own event loop and answers the
worker's messages (stages/torch_engine/core_wire.py): each call a task, its
reply when it ends; a decode call's tokens batched one frame per loop turn
(one step feeds every running stream). It ends when the worker's end of the
socket closes, whatever the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import msgspec
import structlog

from stages.contract import HopContext
from stages.families import MediaEmbedding
from stages.sampling import Logprobs
from stages.torch_engine.core_wire import (
    Abort,
    Broken,
    CacheReset,
    Canary,
    Cancel,
    Decode,
    Done,
    DropMedia,
    EmbeddingInfo,
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

if TYPE_CHECKING:
    # Not at import: the worker imports this module for the process's entry,
    # and the engine's modules would register its metrics there too.
    from stages.torch_engine.hop_engine import TorchHopEngine, TorchPrefilled

log = structlog.get_logger(__name__)

# How often the core looks whether its room or health changed (blocks come
# back without a message: a release rides the next step).
_WATCH_S = 0.02


def main(path: str, build: Callable[[], TorchHopEngine]) -> None:
    """The process's entry: connect to the worker at ``path``, build the
    engine (``build`` loads the model), serve until the worker goes."""
    # The worker decides when the core stops (after its drain): a Ctrl-C or
    # SIGTERM sent to the whole process group is the worker's to act on.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    asyncio.run(_serve(path, build))


async def _serve(path: str, build: Callable[[], TorchHopEngine]) -> None:
    reader, writer = await asyncio.open_unix_connection(path)
    encoder = msgspec.msgpack.Encoder()
    try:
        hop = build()
    except BaseException as exc:
        writer.write(frame(encoder.encode(StartFailed(f"{type(exc).__name__}: {exc}"))))
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()
        raise
    core = EngineCore(hop, writer)
    try:
        await core.serve(reader)
    finally:
        writer.close()


class EngineCore:
    def __init__(self, hop: TorchHopEngine, writer: asyncio.StreamWriter) -> None:
        self.hop = hop
        self._writer = writer
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ToCore)
        self._ids = itertools.count(1)
        self._media: dict[int, list[MediaEmbedding]] = {}
        self._seqs: dict[int, TorchPrefilled] = {}
        self._calls: dict[int, asyncio.Task[None]] = {}
        self._aborts: set[asyncio.Task[None]] = set()
        # Decode calls' tokens not yet sent, in the order they came.
        self._tokens: dict[int, list[int]] = {}
        # By decode call, the logprobs of its tokens in ``_tokens``.
        self._logprobs: dict[int, dict[int, Logprobs]] = {}
        self._flush_soon = False
        self._room: bool | None = None
        self._broken = False
        from stages.torch_engine.metrics import CORE_HELD

        self._held_media = CORE_HELD.labels("media")
        self._held_seqs = CORE_HELD.labels("sequences")

    async def serve(self, reader: asyncio.StreamReader) -> None:
        await self.hop.start()
        engine = self.hop.torch
        ready = Ready(os.getpid(), sorted(engine.eos_token_ids), engine.max_model_len, str(engine.device))
        ready.held = self.hop.held_bytes()
        self._send(ready)
        watch = asyncio.create_task(self._watch(), name="core-watch")
        try:
            while (payload := await read_frame(reader)) is not None:
                self._on(self._decoder.decode(payload))
        except ConnectionError as exc:
            log.error("engine_core_connection_lost", error=repr(exc))
        finally:
            watch.cancel()
            for task in self._calls.values():
                task.cancel()
            await asyncio.gather(*self._calls.values(), *self._aborts, return_exceptions=True)
            for handle in self._seqs.values():
                await self.hop.abort(handle)
            self._seqs.clear()
            await self.hop.close()

    def _on(self, msg: ToCore) -> None:
        if isinstance(msg, Encode):
            self._start(msg.call, self._encode(msg))
        elif isinstance(msg, Prefill):
            # Taken now, not when the task first runs: a Cancel read right
            # after would cancel it before then, and nothing would drop them.
            media = self._media.pop(msg.media, []) if msg.media else []
            self._start(msg.call, self._prefill(msg, media))
        elif isinstance(msg, Decode):
            self._start(msg.call, self._decode(msg))
        elif isinstance(msg, Cancel):
            if (task := self._calls.get(msg.call)) is not None:
                task.cancel()
        elif isinstance(msg, Abort):
            if (handle := self._seqs.pop(msg.seq, None)) is not None:
                task = asyncio.create_task(self.hop.abort(handle))
                self._aborts.add(task)
                task.add_done_callback(self._aborts.discard)
        elif isinstance(msg, DropMedia):
            self._media.pop(msg.media, None)
        elif isinstance(msg, Scrape):
            from prometheus_client import generate_latest

            self._count()
            self._send(Scraped(msg.call, generate_latest()))
        elif isinstance(msg, ResetCache):
            self._start(msg.call, self._reset_cache(msg.call))
        elif isinstance(msg, Operation):
            self._start(msg.call, self._operate(msg))

    async def _operate(self, msg: Operation) -> Done:
        hop, result = self.hop, None
        if isinstance(msg, LoadLora):
            await hop.load_lora(msg.name, msg.path)
        elif isinstance(msg, UnloadLora):
            await hop.unload_lora(msg.name)
        elif isinstance(msg, Sleep):
            result = await hop.sleep(msg.level)
        elif isinstance(msg, WakeUp):
            await hop.wake_up()
        elif isinstance(msg, Canary):
            await hop.canary()
        self._count()
        return Done(msg.call, hop.held_bytes(), hop.loras(), result or {})

    async def _reset_cache(self, call: int) -> FromCore:
        return CacheReset(call, await self.hop.reset_prefix_cache())

    def _start(self, call: int, work: Coroutine[Any, Any, FromCore | None]) -> None:
        task = asyncio.create_task(self._answer(call, work))
        self._calls[call] = task
        task.add_done_callback(lambda _: self._calls.pop(call, None))

    async def _answer(self, call: int, work: Coroutine[Any, Any, FromCore | None]) -> None:
        try:
            reply = await work
        except asyncio.CancelledError:
            return  # the worker stopped waiting: it expects nothing
        except Exception as exc:
            # The worker logs and counts it with its request id: here it is
            # an answer, like any other.
            self._send(Failed(call, type(exc).__name__, str(exc)))
            return
        if reply is not None:
            self._send(reply)

    # -- the hop's steps ---------------------------------------------------------

    async def _encode(self, msg: Encode) -> Encoded:
        ctx = HopContext(steps=[])
        media = await self.hop.encode(msg.req, ctx)
        handle = next(self._ids) if media else 0
        if media:
            self._media[handle] = media
        items = [EmbeddingInfo(m.num_tokens, list(m.grid_thw), m.kind.value, m.seconds_per_grid) for m in media]
        return Encoded(msg.call, handle, items, ctx.trace, ctx.steps or [])

    async def _prefill(self, msg: Prefill, media: list[MediaEmbedding]) -> Prefilled:
        ctx = HopContext(emitted=msg.emitted, steps=[])
        handle = await self.hop.prefill(msg.req, media, ctx)
        seq = next(self._ids)
        self._seqs[seq] = handle
        return Prefilled(
            msg.call,
            seq,
            handle.prompt_len,
            list(handle.seq.output_ids),
            ctx.trace,
            ctx.steps or [],
            handle.seq.cached_tokens,
            handle.prompt_logprobs,
        )

    async def _decode(self, msg: Decode) -> Finished:
        handle = self._seqs.get(msg.seq)
        if handle is None:
            raise RuntimeError(f"no sequence {msg.seq} in the engine core (aborted, or never prefilled)")
        eos = self.hop.eos_token_ids
        ignore_eos = msg.req.request.sampling.ignore_eos

        # The rule the worker's ChunkEmitter applies: both ends stop at the same token.
        def is_eos(token: int) -> bool:
            return token in eos and not ignore_eos

        ctx = HopContext(emitted=msg.emitted)
        logprobs = handle.seq.logprobs if msg.req.request.sampling.logprobs is not None else None
        sent = 0
        async with contextlib.aclosing(self.hop.decode(handle, msg.req, ctx, is_eos)) as tokens:
            async for token in tokens:
                self._token(msg.call, token)
                if logprobs is not None and len(logprobs) > sent:
                    # Made in order, each before its token is handed out: the newest come last.
                    self._logprobs.setdefault(msg.call, {}).update(itertools.islice(logprobs.items(), sent, None))
                    sent = len(logprobs)
        return Finished(msg.call)

    # -- to the worker -------------------------------------------------------------

    def _token(self, call: int, token: int) -> None:
        self._tokens.setdefault(call, []).append(token)
        if not self._flush_soon:
            # After the other streams the same step woke: one frame a step.
            self._flush_soon = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_soon = False
        if self._tokens:
            streams = list(self._tokens.items())
            logprobs, self._logprobs = self._logprobs, {}
            self._tokens.clear()
            self._write(Tokens(streams, logprobs))

    def _send(self, msg: FromCore) -> None:
        self._flush()  # tokens made before this message go before it
        self._write(msg)

    def _write(self, msg: FromCore) -> None:
        if not self._writer.is_closing():
            self._writer.write(frame(self._encoder.encode(msg)))

    def _count(self) -> None:
        # Read only by a scrape, so counted then.
        self._held_media.set(len(self._media))
        self._held_seqs.set(len(self._seqs))

    async def _watch(self) -> None:
        while True:
            room = self.hop.has_room()
            if room != self._room:
                self._room = room
                self._send(Room(room))
            if not self._broken:
                try:
                    await self.hop.health()
                except Exception as exc:
                    self._broken = True
                    self._send(Broken(repr(exc)))
            await asyncio.sleep(_WATCH_S)
