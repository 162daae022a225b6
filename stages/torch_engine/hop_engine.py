"""The built-in engine (``TorchEngine``) behind the ``HopEngine`` interface.

One thread owns the model (``EngineThread``): encode, prefill, decode steps
and releases run there in submission order, so the event loop stays free
for NATS traffic and a release queued after a step never races it. New
prompts waiting together share one prefill forward (``--prefill-batch``);
decoding is one continuous batch of every in-flight sequence
(``DecodeScheduler``). Tensors that leave the role (embeddings, KV cache)
go through mmpipe's ``TensorStore``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

import structlog
import torch
from opentelemetry.trace import Span
from PIL import Image

from schemas.errors import InvalidRequest, TargetTainted, TensorGone
from schemas.processed import KvHandoff, MediaKind, ProcessedRequest
from schemas.request import ChoiceGroup
from schemas.routes import moves_tensors
from schemas.tensors import TensorRef
from stages.contract import HopContext, TensorStore, step_span
from stages.emitter import eos_check
from stages.encoder import MediaEncoder
from stages.families import MediaEmbedding
from stages.hop_engine import (
    Carried,
    client_ahead,
    get_tensors,
    get_tensors_into,
    put_media,
    put_tensors,
    receive_embeddings,
    sampling,
)
from stages.media import EmbeddingCache, MediaFetcher, MediaPolicy
from stages.media.cache import item_digest_off_loop
from stages.media.inline import inline_bytes
from stages.media.layouts import MediaLayouts
from stages.prompt_embeds import load_prompt_embeds
from stages.sampling import Logprobs, SamplingConfig
from stages.torch_engine.call_batcher import CallBatcher
from stages.torch_engine.engine import MediaNotEncoded, TorchEngine
from stages.torch_engine.metrics import WARM_UP_FAILURES
from stages.torch_engine.scheduler import DecodeScheduler, EngineThread, Running
from stages.torch_engine.sequence import KvState, Sequence

log = structlog.get_logger(__name__)

# A new prompt to prefill: its ids (a placeholder per media item), its media, its sampling.
PrefillJob = tuple[list[int], list[MediaEmbedding], SamplingConfig]


@dataclass(eq=False)
class _Choices:
    """The choices of one prompt (``ChoiceGroup``) this worker has taken: the
    first prefills the prompt (``source``), the others fork from it, until
    every one came or the first's hop ends."""

    prompt: list[int]
    digests: list[str]
    lora: str
    source: asyncio.Future[Sequence | None]
    # Choices still to come, and forks running.
    expected: int
    forking: int = 0

    def same(self, req: ProcessedRequest, media: list[MediaEmbedding]) -> bool:
        return (
            req.prompt_token_ids == self.prompt and [m.digest for m in media] == self.digests and req.lora == self.lora
        )


@dataclass(eq=False)
class TorchPrefilled:
    seq: Sequence
    # The hop still owns the sequence's cache, so abort() frees it; off once
    # it is exported, or once the decode loop took it (which frees it then).
    owned: bool = True
    # The prompt's logprobs, where the request asked for them (echo with logprobs).
    prompt_logprobs: list[Logprobs] | None = None
    # Its prompt's other choices fork from it (its group's id, while they may).
    source_of: str = ""
    # The decode batch took it before its first token reached the host (``_join_early``).
    joined: Running | None = None

    @property
    def prompt_len(self) -> int:
        return self.seq.prompt_len

    @property
    def cached_tokens(self) -> int:
        return self.seq.cached_tokens


# How long sleep waits for handed-back requests' sequences to leave the pool.
_SLEEP_WAIT_S = 10.0


class TorchHopEngine:
    def __init__(
        self,
        role: str,
        engine: TorchEngine,
        tensors: TensorStore | None = None,
        media_policy: MediaPolicy | None = None,
        max_batch: int = 32,
        embedding_cache: EmbeddingCache | None = None,
        prefill_batch: int = 1,
        step_priority_s: float | None = None,
        gpu_call_spans: bool = False,
        calls_ahead_of_step: int = 0,
    ) -> None:
        if tensors is None and moves_tensors(role):
            raise ValueError(f"role {role} hands tensors to or from another hop: it needs a tensor store")
        steps = role.split("+")
        self.role = role
        self.torch = engine
        # What the chunks and the context check read: fixed once the model is loaded.
        self.tokenizer: Any = engine.tokenizer
        self.eos_token_ids = engine.eos_token_ids
        self.max_model_len = engine.max_model_len
        self.tensors = tensors
        cuda = engine.device.type == "cuda"
        self.thread = EngineThread(
            step_priority_s, gpu_spans=gpu_call_spans and cuda, others_ahead=calls_ahead_of_step if cuda else 0
        )
        policy = media_policy or MediaPolicy()
        self.fetcher = MediaFetcher(policy) if "encode" in steps else None
        self.encoder = (
            MediaEncoder(engine, self.thread, self.fetcher, policy, embedding_cache, tensors)
            if self.fetcher is not None
            else None
        )
        if self.encoder is not None and "prefill" in steps and engine.prefix_caching:
            self.encoder.prefix_probe = self._prefix_covers
        # A role that prefills media another worker encodes: a router may
        # send it a request past the encode hop where its prefix cache holds
        # the media's tokens; it stands in for them by the layouts it saw.
        self.takes_cached_media = self.encoder is None and "prefill" in steps and engine.prefix_caching
        self._layouts = MediaLayouts()
        self.scheduler = DecodeScheduler(engine, self.thread, max_batch=max_batch) if "decode" in steps else None
        # New prompts waiting together share one forward (--prefill-batch); a
        # result whose request was cancelled meanwhile frees its cache.
        # Run at close (a KV events publisher's), and where this engine's KV events go ("": nowhere).
        self.closers: list[Callable[[], None]] = []
        self.kv_events_endpoint = ""
        self.prefills: CallBatcher[PrefillJob, tuple[Sequence, int]] = CallBatcher(
            "prefill", engine.prefill_together, self.thread, prefill_batch, orphan=lambda out: engine.release(out[0])
        )
        # The choices of one prompt taken here, by group id: one prefill for them.
        self._choices: dict[str, _Choices] = {}

    async def start(self) -> None:
        if self.scheduler is not None:
            self.scheduler.start()
        await self._warm_up()

    async def _warm_up(self) -> None:
        """What a fresh worker's first request would pay once, paid before it
        takes one (as vLLM's dummy run at start): the media decoders started
        and a small image through the tower and a few tokens prefilled (the
        canary). 2-vCPU machine, tiny model, a 64x64 PNG and 1,500 tokens: a
        fresh worker's first request spent 17 ms more in it than its second
        (decode 5.4 against 0.9 ms, encode 8.2 against 3.2, prefill 27.8
        against 22.2), and on a GPU worker the decoders' processes are
        spawned then. A failure is logged and counted; the canary judges."""
        started = time.monotonic()
        try:
            if self.encoder is not None:
                await self.encoder.warm_up()
            await self.canary()
        except Exception as exc:
            WARM_UP_FAILURES.labels(self.role).inc()
            log.error("engine_warm_up_failed", role=self.role, error=repr(exc))
            return
        log.info("engine_warmed_up", role=self.role, seconds=round(time.monotonic() - started, 3))

    async def close(self) -> None:
        if self.scheduler is not None:
            await self.scheduler.close()
        if self.fetcher is not None:
            await self.fetcher.close()
        if self.encoder is not None:
            self.encoder.close()
        self.thread.close()
        for close in self.closers:
            close()

    def has_room(self) -> bool:
        """Whether to take another request: the KV pool has blocks to spare
        and no sequence waits for them."""
        if self.scheduler is not None and self.scheduler.blocked:
            return False
        return self.torch.has_room()

    def kv_usage(self) -> tuple[int, int]:
        """KV blocks running sequences hold, of the pool's (0, 0: no pool)."""
        decoder = self.torch.decoder
        if decoder is None:
            return 0, 0
        pool = decoder.pool
        return pool.capacity - pool.num_free, pool.capacity

    async def reset_prefix_cache(self) -> int | None:
        """Forget the cached prefixes: blocks cached, now forgotten (None: no pool)."""
        return await self.thread.call(self.torch.reset_prefix_cache)

    async def load_lora(self, name: str, path: str) -> None:
        """Load a LoRA adapter (PEFT's format) for requests that name it (again: nothing)."""
        await self.thread.call(self.torch.load_lora, name, path)

    async def unload_lora(self, name: str) -> None:
        """Unload an adapter once no sequence here uses it (no new request
        names it by then: it is no longer served)."""
        deadline = time.monotonic() + 120.0
        while True:
            try:
                await self.thread.call(self.torch.unload_lora, name)
                return
            except InvalidRequest:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)

    def loras(self) -> list[str]:
        return self.torch.loras()

    async def sleep(self, level: int) -> dict[str, int]:
        """The engine's sleep (``TorchEngine.sleep``): the bytes it held.
        The requests were handed back before: their sequences leave as the
        decode loop and the engine thread get to them (under load, after
        the calls queued before), so the engine is waited for, a while,
        until it is idle: no sequence in the pool or the decode loop, no
        prefill running or queued (a cancelled caller's sequence is
        released after it), no call on the engine thread."""
        deadline = time.monotonic() + _SLEEP_WAIT_S
        # Polled: these change on the engine thread and in tasks, which signal no event.
        while self._busy() and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        return await self.thread.call(self.torch.sleep, level)

    def _busy(self) -> bool:
        scheduler = self.scheduler
        return bool(
            self.torch.holding
            or self.thread.unsettled
            or not self.thread.quiet
            or self.prefills.busy
            or (scheduler is not None and scheduler.holds)
        )

    async def wake_up(self) -> None:
        await self.thread.call(self.torch.wake_up)

    def held_bytes(self) -> dict[str, int]:
        return self.torch.held_bytes()

    async def canary(self) -> None:
        """A tiny request through this engine's thread and model (a worker's
        canary health check): a small image through the encoder where this
        role encodes (and the model takes images), a few prompt tokens
        prefilled and one token chosen where it prefills or decodes."""
        engine = self.torch
        if self.encoder is not None and MediaKind.IMAGE in engine.family.placeholder_ids:
            image = Image.new("RGB", (56, 56), (128, 64, 32))
            await self.thread.call(lambda: engine.encode(engine.prepare([image])))
        if self.role == "encode":
            return
        ids = list(engine.tokenizer("ok")["input_ids"])[:4] or [0]

        def prefill() -> None:
            [(seq, _)] = engine.prefill([ids], [[]], [SamplingConfig(max_tokens=1)])
            engine.release(seq)

        await self.thread.call(prefill)

    async def health(self) -> None:
        """Raises once the decode loop has stopped other than by ``close()``:
        the worker would take requests whose streams never get a token. (The
        engine thread itself cannot die: a call that fails fails its caller.)"""
        if self.scheduler is not None:
            self.scheduler.check()

    # -- encode ---------------------------------------------------------------

    async def encode(self, req: ProcessedRequest, ctx: HopContext) -> list[MediaEmbedding]:
        assert self.encoder is not None, f"role {self.role} does not encode"
        return await self.encoder.encode(req, ctx)

    async def _prefix_covers(self, req: ProcessedRequest, media: list[MediaEmbedding]) -> bool:
        return self.torch.prefix_covers(req.prompt_token_ids, media, req.lora or None)

    async def send_media(self, media: list[MediaEmbedding], req: ProcessedRequest, ctx: HopContext) -> Carried:
        # Stand-ins come only where this role prefills too.
        assert all(m.encoded for m in media), "media the encoder skipped cannot leave the role"
        if not media:  # nothing to encode: prefill needs nothing from here
            return Carried()
        return Carried(encoded=await put_media(self.tensors, media, req, ctx))

    async def receive_media(self, req: ProcessedRequest, ctx: HopContext) -> list[MediaEmbedding]:
        if req.encode_skipped:
            return await self._cached_media(req, ctx)
        media = await receive_embeddings(self.role, self.tensors, req, self.torch.device, ctx)
        if self.takes_cached_media:
            self._layouts.remember(media)
        return media

    async def _cached_media(self, req: ProcessedRequest, ctx: HopContext) -> list[MediaEmbedding]:
        """Stand-ins for media the router did not have encoded: their tokens
        were in this worker's prefix cache when it looked. A worker that
        does not know them (it never prefilled them, or forgot) runs the
        request again from the encode hop."""
        digests = []
        for i, item in enumerate(req.media):
            data = inline_bytes(req, i)
            digests.append("" if data is None else await item_digest_off_loop(item, data))
        engine = self.torch
        stand_ins = (
            self._layouts.stand_ins(digests, engine.family.hidden_size, engine.dtype, engine.device)
            if self.takes_cached_media
            else None
        )
        if stand_ins is None:
            raise TensorGone(f"{self.role} does not know the media the router skipped their encoding for")
        ctx.trace["encode_skipped"] = float(len(stand_ins))
        return stand_ins

    # -- prefill --------------------------------------------------------------

    async def prefill(self, req: ProcessedRequest, media: list[MediaEmbedding], ctx: HopContext) -> TorchPrefilled:
        handle = await self._prefill(req, media, ctx)
        top = req.request.sampling.prompt_logprobs
        if top is not None and not ctx.emitted:
            try:
                with ctx.timed("prompt_logprobs", tokens=len(req.prompt_token_ids)):
                    handle.prompt_logprobs = await self.thread.call(
                        self.torch.prompt_logprobs, req.prompt_token_ids, top, req.lora or None
                    )
            except BaseException:
                await self.abort(handle)
                raise
        return handle

    async def _prefill(self, req: ProcessedRequest, media: list[MediaEmbedding], ctx: HopContext) -> TorchPrefilled:
        group = req.request.group
        # A takeover's, media whose content is not known, and embeddings (no ids to tell them by) never share.
        if (
            group is None
            or group.size < 2
            or ctx.emitted
            or req.request.prompt_embeds is not None
            or not all(m.encoded and m.digest for m in media)
        ):
            return await self._prefill_own(req, media, ctx)
        choices = self._choices.get(group.id)
        if choices is None:
            return await self._prefill_source(group, req, media, ctx)
        if not choices.same(req, media):
            return await self._prefill_own(req, media, ctx)
        choices.expected -= 1
        forked = None
        # Shielded: a choice whose client goes away leaves the first's prefill alone.
        source = await asyncio.shield(choices.source)
        if source is not None:
            choices.forking += 1
            try:
                with ctx.timed("prefill_fork", tokens=len(req.prompt_token_ids)):
                    forked = await self.thread.call_or_release(
                        _release_forked(self.torch), lambda: self.torch.fork(source, sampling(req))
                    )
            finally:
                choices.forking -= 1
                if choices.expected <= 0 and not choices.forking:
                    self._forget(group.id, choices)
        if forked is None:  # the first's prefill failed, or it went on past its prompt
            return await self._prefill_own(req, media, ctx)
        ctx.trace["prefill_forked"] = 1.0
        return TorchPrefilled(forked[0])

    async def _prefill_source(
        self, group: ChoiceGroup, req: ProcessedRequest, media: list[MediaEmbedding], ctx: HopContext
    ) -> TorchPrefilled:
        """The first of a prompt's choices here: its prefill, kept for the others to fork from."""
        source: asyncio.Future[Sequence | None] = asyncio.get_running_loop().create_future()
        choices = _Choices(list(req.prompt_token_ids), [m.digest for m in media], req.lora, source, group.size - 1)
        self._choices[group.id] = choices
        try:
            handle = await self._prefill_own(req, media, ctx)
        except BaseException:
            source.set_result(None)
            self._forget(group.id, choices)
            raise
        handle.seq.forkable = True
        handle.source_of = group.id
        source.set_result(handle.seq)
        return handle

    def _forget(self, group_id: str, choices: _Choices) -> None:
        """No more forks of this group here: its first's prefill logits can go."""
        if self._choices.get(group_id) is choices:
            del self._choices[group_id]
        source = choices.source.result() if choices.source.done() else None
        if source is not None:
            source.forkable = False
            source.prompt_logits = None

    async def _prefill_own(self, req: ProcessedRequest, media: list[MediaEmbedding], ctx: HopContext) -> TorchPrefilled:
        with ctx.timed("prefill", tokens=len(req.prompt_token_ids)):
            handle = TorchPrefilled(await self._prefilled(req, media, ctx))
            if handle.seq.pending is not None:
                handle.joined = self._join_early(handle.seq, req, ctx)
                if handle.joined is not None:
                    handle.owned = False  # the decode loop frees it
                    ctx.trace["joined_early"] = 1.0
                await self._settle(handle)
        return handle

    async def _prefilled(self, req: ProcessedRequest, media: list[MediaEmbedding], ctx: HopContext) -> Sequence:
        """The prompt's sequence, its first token perhaps still on its way to the host (``pending``)."""
        engine = self.torch
        # Placeholders expanded: each media item's one id becomes its tokens.
        expanded = len(req.prompt_token_ids) + sum(m.num_tokens - 1 for m in media)
        lora = req.lora or None
        if req.request.prompt_embeds is not None:
            # In one piece, alone: embeddings look up no cached prefix and are
            # neither batched nor chunked.
            embeds = self._embeds(req)
            try:
                return await self._prefill_alone(req, media, ctx, embeds)
            except MediaNotEncoded:
                # The blocks the encoder skipped media for went since it looked.
                media = await self._encoded_after_all(req, ctx)
                return await self._prefill_alone(req, media, ctx, embeds)
        if not all(m.encoded for m in media):
            # Only a lone prefill looks the prefix up (not chunks, not a batch).
            try:
                return await self._prefill_alone(req, media, ctx)
            except MediaNotEncoded:
                # Its blocks went between the encoder's (or the router's) look and now.
                media = await self._encoded_after_all(req, ctx)
        # A prompt that finds its prefix cached goes alone (its rest in chunks
        # only where the rest is long; chunks into blocks start past the prefix).
        cached = 0 if ctx.emitted else engine.prefix_cached(req.prompt_token_ids, media, lora)
        if not ctx.emitted and engine.chunked(expanded - cached):
            return await self._prefill_in_chunks(req, media, ctx)
        # Prompts prefilled together run without adapters (the batcher's jobs carry none).
        if self.prefills.max_items > 1 and not ctx.emitted and not cached and not lora:
            seq, _ = await self.prefills.submit((req.prompt_token_ids, media, sampling(req)))
            return seq
        return await self._prefill_alone(req, media, ctx)

    async def _encoded_after_all(self, req: ProcessedRequest, ctx: HopContext) -> list[MediaEmbedding]:
        """The media, encoded after all: here where this role encodes, else by
        the encode hop, the request run again from it."""
        ctx.trace["encode_skipped"] = 0.0
        if self.encoder is None:
            raise TensorGone("the prefix cache no longer holds the media the router skipped their encoding for")
        return await self.encoder.encode(req, ctx, reuse_prefix=False)

    def _join_early(self, seq: Sequence, req: ProcessedRequest, ctx: HopContext) -> Running | None:
        """The decode batch takes a sequence whose prefill's token is still on
        its way to the host, where its first step can feed that token from
        the device: the step launched next, not the one after the token's
        wait (the loop runs a step ahead: one that joined after the wait
        got its second token three step intervals after its first; H200,
        64 clients, 2026-11-28). Not a prompt whose choices fork from it,
        nor one that asks for the prompt's logprobs (both read its prefill
        before it steps), nor one whose first token is its last."""
        decoder, scheduler, asked = self.torch.decoder, self.scheduler, req.request
        if scheduler is None or decoder is None or not decoder.is_cell(seq.feed_row):
            return None
        if ctx.emitted or req.max_tokens < 2 or asked.sampling.prompt_logprobs is not None:
            return None
        if asked.group is not None and asked.group.size > 1:
            return None
        try:
            scheduler.check()
        except RuntimeError:
            return None  # decode() says so
        is_eos = eos_check(self.eos_token_ids, asked.sampling)
        return scheduler.join(seq, lambda token: is_eos(token) or seq.num_generated >= req.max_tokens)

    def _embeds(self, req: ProcessedRequest) -> torch.Tensor:
        assert req.request.prompt_embeds is not None
        return load_prompt_embeds(req.request.prompt_embeds, self.torch.family.hidden_size)

    async def _prefill_alone(
        self, req: ProcessedRequest, media: list[MediaEmbedding], ctx: HopContext, embeds: torch.Tensor | None = None
    ) -> Sequence:
        engine = self.torch

        def prefill_one() -> tuple[Sequence, int]:
            job = [req.prompt_token_ids], [media], [sampling(req)], [ctx.emitted]
            return engine.prefill(*job, defer=True, embeds=[embeds], loras=[req.lora or None])[0]

        # Text alone, not resumed: its places are its ids, and it is one forward.
        small = not media and embeds is None and not ctx.emitted and engine.small_prefill(len(req.prompt_token_ids))
        seq, _ = await self.thread.call_or_release(lambda out: engine.release(out[0]), prefill_one, small=small)
        return seq

    async def _prefill_in_chunks(self, req: ProcessedRequest, media: list[MediaEmbedding], ctx: HopContext) -> Sequence:
        """A long prompt in chunks of ``--max-num-batched-tokens``: where this
        role decodes, each carried by a decode step (in its forward where the
        fused layers prefill into blocks), else one engine call each."""
        engine = self.torch
        prefilling = await self.thread.call(
            engine.start_prefill, req.prompt_token_ids, media, sampling(req), req.lora or None
        )

        def prefill_chunk() -> tuple[Sequence, int] | None:
            return engine.prefill_chunk(prefilling, defer=True)

        def release(out: tuple[Sequence, int] | None) -> None:
            if out is not None:
                engine.release(out[0])

        chunks = 0
        out = None
        try:
            while out is None:
                if self.scheduler is not None:
                    out = await self.scheduler.prefill_chunk(prefilling)
                else:
                    out = await self.thread.call_or_release(release, prefill_chunk)
                chunks += 1
        finally:
            if out is None:
                # Given up between chunks (cancelled, failed): after any chunk still queued, its blocks go.
                self.thread.submit(engine.drop_prefill, prefilling)
        ctx.trace["prefill_chunks"] = float(chunks)
        return out[0]

    async def _settle(self, handle: TorchPrefilled) -> None:
        """Wait for the prefill's token off the engine's thread, which goes
        on with other requests' work meanwhile."""
        try:
            await asyncio.to_thread(self.torch.settle, handle.seq)
        except BaseException:
            self._drop(handle)
            raise

    # Chosen on the host for a request that asks (TorchEngine._select).
    supports_logprobs = True

    def logprobs(self, handle: TorchPrefilled, index: int) -> Logprobs | None:
        return handle.seq.logprobs.get(index)

    def prompt_logprobs(self, handle: TorchPrefilled) -> list[Logprobs] | None:
        return handle.prompt_logprobs

    def first_token(self, handle: TorchPrefilled) -> int | None:
        # Prefill covered the prompt and what the client held; the one token
        # after them is pending (selected, not yet in the cache).
        return handle.seq.output_ids[-1]

    async def hand_off(self, handle: TorchPrefilled, req: ProcessedRequest, ctx: HopContext) -> Carried:
        try:
            tensors, state = await self.thread.call(self.torch.export_kv, handle.seq)
            ref = await put_tensors(self.tensors, tensors, req.request.request_id, ctx)
        finally:
            await self.abort(handle)  # the store holds a copy now, or it failed
        kv = KvHandoff(ref, state.prompt_len, state.output_ids, state.rope_delta, handle.seq.cached_tokens)
        return Carried(kv=kv)

    async def receive_prefilled(self, req: ProcessedRequest, ctx: HopContext) -> TorchPrefilled:
        if req.kv is None:
            raise InvalidRequest(f"a request reached {self.role} without its KV cache")
        kv = req.kv
        state = KvState(kv.prompt_len, list(kv.output_ids), kv.rope_delta)

        # Straight into blocks of the decoder's pool where the cache comes as
        # they are (this engine's dtype and block size): no copy after the
        # transfer. Not for a takeover whose client holds tokens past the
        # cache: those are fed one step each first, which a sequence in the
        # batch decoder cannot take alone.
        def reserve_kv() -> tuple[Sequence, list[list[torch.Tensor]]] | None:
            return self.torch.reserve_kv(state, sampling(req), lora=req.lora or None)

        resumes = client_ahead(state.output_ids, ctx.emitted)
        reserved = None if resumes else await self.thread.call_or_release(self._drop_reserved, reserve_kv)
        if reserved is not None and _fits(kv.ref, reserved[1]):
            await self._read_into_slot(reserved[0], kv.ref, reserved[1], ctx)
            reserved[0].cached_tokens = kv.cached_tokens
            return TorchPrefilled(reserved[0])
        self._drop_reserved(reserved)
        tensors = await get_tensors(self.tensors, kv.ref, self.torch.device, ctx)

        def import_kv() -> Sequence:
            return self.torch.import_kv(tensors, state, sampling(req), lora=req.lora or None)

        seq = await self.thread.call_or_release(self.torch.release, import_kv)
        seq.cached_tokens = kv.cached_tokens
        return TorchPrefilled(seq)

    def _drop_reserved(self, reserved: tuple[Sequence, list[list[torch.Tensor]]] | None) -> None:
        if reserved is not None:
            self.thread.submit(self.torch.abandon, reserved[0], False)

    async def _read_into_slot(
        self, seq: Sequence, ref: TensorRef, targets: list[list[torch.Tensor]], ctx: HopContext
    ) -> None:
        try:
            await asyncio.to_thread(self.torch.wait_quiet, seq)
            await get_tensors_into(self.tensors, ref, list(targets), ctx)
            await self.thread.call(self.torch.received, seq)
        except BaseException as exc:
            # After received() if that ran: the thread keeps the order. A READ
            # that may still write the blocks keeps them out of use for good.
            self.thread.submit(self.torch.abandon, seq, isinstance(exc, TargetTainted))
            raise

    # -- decode ---------------------------------------------------------------

    async def decode(
        self, handle: TorchPrefilled, req: ProcessedRequest, ctx: HopContext, is_eos: Callable[[int], bool]
    ) -> AsyncGenerator[int, None]:
        assert self.scheduler is not None, f"role {self.role} does not decode"
        seq, emitted, joined = handle.seq, ctx.emitted, handle.joined
        if joined is not None:
            first = seq.output_ids[:1]  # the steps' tokens after it come from the loop
        elif client_ahead(seq.output_ids, emitted):
            first = [await self.thread.call(self.torch.resume, seq, emitted)]
        else:
            first = seq.output_ids[len(emitted) :]

        def is_last(token: int) -> bool:
            # Decided on the decode loop, before the next step: a finished
            # sequence never takes a step it has no use for.
            return is_eos(token) or seq.num_generated >= req.max_tokens

        if first and is_last(first[-1]):
            for token in first:
                yield token
            return  # the hop's abort frees it (or takes it out of the batch)
        scheduler = self.scheduler
        if joined is not None:
            handle.joined = None  # left below
            joined.is_last = is_last
        else:
            scheduler.check()  # a dead loop would take the sequence and never free it
            # The batch takes it before its first token goes out: that token's way
            # to the client and the sequence's first step overlap.
            handle.owned = False  # from here on the decode loop frees it
            joined = scheduler.join(seq, is_last)
        # Until the decode loop's first token for it: joining the batch and one step.
        first_step: Span | None = step_span("first_step")
        try:
            for token in first:
                yield token
            async with contextlib.aclosing(scheduler.tokens(joined)) as tokens:
                async for token in tokens:
                    if first_step is not None:
                        first_step.end()
                        first_step = None
                    yield token
        finally:
            scheduler.leave(joined)
            if first_step is not None:
                first_step.end()

    async def abort(self, handle: TorchPrefilled) -> None:
        if handle.source_of:
            choices = self._choices.get(handle.source_of)
            if choices is not None and choices.source.done() and choices.source.result() is handle.seq:
                self._forget(handle.source_of, choices)
            handle.source_of = ""
        self._drop(handle)

    def _drop(self, handle: TorchPrefilled) -> None:
        """Its sequence goes: freed, or out of the decode batch that took it early."""
        if handle.joined is not None:
            assert self.scheduler is not None
            self.scheduler.leave(handle.joined)
            handle.joined = None
        if handle.owned:
            handle.owned = False
            self.thread.submit(self.torch.release, handle.seq)


def _release_forked(engine: TorchEngine) -> Callable[[tuple[Sequence, int] | None], None]:
    def release(out: tuple[Sequence, int] | None) -> None:
        if out is not None:
            engine.release(out[0])

    return release


def _fits(ref: TensorRef, targets: list[list[torch.Tensor]]) -> bool:
    """Whether the ref's tensors are the targets' dtypes and shapes, each
    tensor's blocks one piece of its target (a prefill worker of another
    dtype or block size hands over tensors to convert)."""
    return len(ref.tensors) == len(targets) and all(
        len(pieces) == spec.shape[0]
        and all(
            spec.dtype == str(p.dtype).removeprefix("torch.") and list(spec.shape[1:]) == list(p.shape) for p in pieces
        )
        for spec, pieces in zip(ref.tensors, targets, strict=True)
    )
