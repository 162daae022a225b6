"""A hop: one or more contiguous steps of encode → prefill → decode.

Every worker role is a run of these steps (``encode``, ``prefill+decode``,
``encode+prefill+decode``, …). Steps inside one role hand their tensors over
in memory; at a role's end the tensors go to the ``TensorStore`` and only a
reference rides in the message to the next hop:

- encode → prefill: one embeddings tensor per media item (``EncodedMedia``);
- prefill → decode: per-layer keys and values, the tokens after the prompt
  and the M-RoPE delta (``KvHandoff``).

The prefill step covers the prompt plus whatever a client already received
(a takeover), so decoding never re-emits or changes a token the client saw.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import msgspec
import torch

from schemas.chunk import TokenChunk
from schemas.errors import ContextLengthExceeded, InvalidRequest
from schemas.processed import EncodedItem, EncodedMedia, KvHandoff, ProcessedRequest
from schemas.request import GenerateRequest
from schemas.routes import HOP_ROLES, moves_tensors
from schemas.tensors import TensorRef
from stages.call_batcher import CallBatcher
from stages.contract import HopContext, StageOutput, TensorStore
from stages.emitter import ChunkEmitter
from stages.encoder import MediaEncoder
from stages.engine import KvState, MediaEmbedding, SamplingConfig, Sequence, TorchEngine
from stages.media import EmbeddingCache, MediaFetcher, MediaPolicy
from stages.scheduler import DecodeScheduler, EngineThread

# A new prompt to prefill: its ids (a placeholder per media item), its media, its sampling.
PrefillJob = tuple[list[int], list[MediaEmbedding], SamplingConfig]

STEPS = ("encode", "prefill", "decode")


@dataclass(frozen=True)
class _Steps:
    encode: bool
    prefill: bool
    decode: bool

    @classmethod
    def of(cls, role: str) -> _Steps:
        if role not in HOP_ROLES:
            raise ValueError(f"{role!r} is not a hop role; hop roles: {', '.join(HOP_ROLES)}")
        steps = role.split("+")
        return cls(*(step in steps for step in STEPS))


class HopStage:
    input_type = ProcessedRequest

    def __init__(
        self,
        role: str,
        engine: TorchEngine,
        served_name: str,
        tensors: TensorStore | None = None,
        media_policy: MediaPolicy | None = None,
        max_batch: int = 32,
        embedding_cache: EmbeddingCache | None = None,
        prefill_batch: int = 1,
    ) -> None:
        self.role = role
        self.steps = _Steps.of(role)
        if tensors is None and moves_tensors(role):
            raise ValueError(f"role {role} hands tensors to or from another hop: it needs a tensor store")
        self.resumes_stream = self.steps.prefill or self.steps.decode
        self.engine = engine
        self.served_name = served_name
        self.tensors = tensors
        self.media_policy = media_policy or MediaPolicy()
        self.fetcher = MediaFetcher(self.media_policy) if self.steps.encode else None
        self.thread = EngineThread()
        self.encoder = (
            MediaEncoder(engine, self.thread, self.fetcher, self.media_policy, embedding_cache)
            if self.fetcher is not None
            else None
        )
        self.scheduler = DecodeScheduler(engine, self.thread, max_batch=max_batch) if self.steps.decode else None
        # New prompts waiting together share one forward (--prefill-batch); a
        # result whose request was cancelled meanwhile frees its cache.
        self.prefills: CallBatcher[PrefillJob, tuple[Sequence, int]] = CallBatcher(
            "prefill", engine.prefill_together, self.thread, prefill_batch, orphan=lambda out: engine.release(out[0])
        )

    @property
    def models(self) -> list[str]:
        return [self.served_name]

    async def start(self) -> None:
        if self.scheduler is not None:
            self.scheduler.start()

    async def close(self) -> None:
        if self.scheduler is not None:
            await self.scheduler.close()
        if self.fetcher is not None:
            await self.fetcher.close()
        self.thread.close()

    async def run(
        self, message: GenerateRequest | ProcessedRequest, ctx: HopContext
    ) -> AsyncGenerator[StageOutput, None]:
        assert isinstance(message, ProcessedRequest)
        req = message
        rid = req.request.request_id
        if self.steps.encode or self.steps.prefill:
            if self.steps.encode:
                assert self.encoder is not None
                encoded = await self.encoder.encode(req, ctx)
            else:
                encoded = await self._receive_embeddings(req, ctx)
            if not self.steps.prefill:
                if not encoded:  # nothing to encode: prefill needs nothing from here
                    yield _next_hop(req)
                    return
                ref = await self._put([e.embeddings for e in encoded], rid, ctx)
                items = [EncodedItem(e.num_tokens, list(e.grid_thw), e.seconds_per_grid) for e in encoded]
                yield _next_hop(req, encoded=EncodedMedia(ref, items))
                return
            seq = await self._prefill(req, encoded, ctx)
        else:
            seq = await self._receive_kv(req, ctx)
        if not self.steps.decode:
            try:
                tensors, state = await self.thread.call(self.engine.export_kv, seq)
                ref = await self._put(tensors, rid, ctx)
            finally:
                self.thread.submit(self.engine.release, seq)
            yield _next_hop(req, kv=KvHandoff(ref, state.prompt_len, state.output_ids, state.rope_delta))
            return
        async for chunk in self._decode(req, seq, ctx.emitted):
            yield chunk

    # -- encode ---------------------------------------------------------------

    async def _receive_embeddings(self, req: ProcessedRequest, ctx: HopContext) -> list[MediaEmbedding]:
        return await receive_embeddings(self.role, self.tensors, req, self.engine.device, ctx)

    # -- prefill --------------------------------------------------------------

    async def _prefill(self, req: ProcessedRequest, encoded: list[MediaEmbedding], ctx: HopContext) -> Sequence:
        prompt_len = len(req.prompt_token_ids) + sum(e.num_tokens - 1 for e in encoded)
        if prompt_len + req.max_tokens > self.engine.max_model_len:
            raise ContextLengthExceeded(
                f"a prompt of {prompt_len} tokens plus max_tokens {req.max_tokens} exceeds the context of "
                f"{self.engine.max_model_len} tokens"
            )
        started = time.monotonic()
        if self.prefills.max_items > 1 and not ctx.emitted:
            seq, _ = await self.prefills.submit((req.prompt_token_ids, encoded, _sampling(req)))
        else:
            seq, _ = await self.thread.call_or_release(
                lambda out: self.engine.release(out[0]),
                lambda: self.engine.prefill([req.prompt_token_ids], [encoded], [_sampling(req)], [ctx.emitted])[0],
            )
        ctx.trace["prefill_s"] = time.monotonic() - started
        return seq

    async def _receive_kv(self, req: ProcessedRequest, ctx: HopContext) -> Sequence:
        if req.kv is None:
            raise InvalidRequest(f"a request reached {self.role} without its KV cache")
        kv = req.kv
        tensors = await self._get(kv.ref, ctx)
        state = KvState(kv.prompt_len, list(kv.output_ids), kv.rope_delta)
        return await self.thread.call_or_release(
            self.engine.release, lambda: self.engine.import_kv(tensors, state, _sampling(req))
        )

    # -- decode ---------------------------------------------------------------

    async def _decode(
        self, req: ProcessedRequest, seq: Sequence, emitted: list[int]
    ) -> AsyncGenerator[TokenChunk, None]:
        assert self.scheduler is not None
        streaming = False
        try:
            emitter = ChunkEmitter(self.engine, req, seq.prompt_len, emitted)
            if len(emitted) >= req.max_tokens:
                yield emitter.finish_now()
                return
            if len(emitted) >= len(seq.output_ids):
                # The client holds more than this sequence covers (a takeover
                # raced an earlier attempt): its tokens win.
                first = [await self.thread.call(self.engine.resume, seq, emitted)]
            else:
                first = seq.output_ids[len(emitted) :]
            for token in first:
                chunk = emitter.push(token)
                yield chunk
                if chunk.finish_reason is not None:
                    return
            streaming = True

            def is_last(token: int) -> bool:
                # Decided on the decode loop, before the next step: a finished
                # sequence never takes a step it has no use for.
                return emitter.is_eos(token) or seq.num_generated >= req.max_tokens

            async for token in self.scheduler.stream(seq, is_last):
                chunk = emitter.push(token)
                yield chunk
                if chunk.finish_reason is not None:
                    return
        finally:
            if not streaming:  # once streaming, the decode loop releases it
                self.thread.submit(self.engine.release, seq)

    # -- tensors --------------------------------------------------------------

    async def _put(self, tensors: list[torch.Tensor], owner: str, ctx: HopContext) -> TensorRef:
        assert self.tensors is not None
        started = time.monotonic()
        ref = await self.tensors.put(tensors, owner=owner)
        ctx.trace["put_s"] = time.monotonic() - started
        ctx.trace["put_bytes"] = float(ref.nbytes)
        return ref

    async def _get(self, ref: TensorRef, ctx: HopContext) -> list[torch.Tensor]:
        assert self.tensors is not None
        return await get_tensors(self.tensors, ref, self.engine.device, ctx)


async def get_tensors(
    tensors: TensorStore, ref: TensorRef, device: torch.device | str, ctx: HopContext
) -> list[torch.Tensor]:
    """Tensors another hop put, with the seconds and bytes on the trace."""
    started = time.monotonic()
    out = await tensors.get(ref, device)
    ctx.trace["get_s"] = time.monotonic() - started
    ctx.trace["get_bytes"] = float(ref.nbytes)
    return out


async def receive_embeddings(
    role: str, tensors: TensorStore | None, req: ProcessedRequest, device: torch.device | str, ctx: HopContext
) -> list[MediaEmbedding]:
    """The embeddings an encode hop put for ``req``'s media (none for a text
    request): what a hop that prefills without encoding starts from, whatever
    its engine."""
    if not req.media:
        return []
    if req.encoded is None:
        raise InvalidRequest(f"a request with media reached {role} without its embeddings")
    assert tensors is not None
    got = await get_tensors(tensors, req.encoded.ref, device, ctx)
    items = req.encoded.items
    if len(got) != len(items) or len(items) != len(req.media):
        raise InvalidRequest(f"{len(got)} embeddings for {len(items)} encoded and {len(req.media)} media items")
    return [
        MediaEmbedding(t, tuple(i.grid_thw), m.kind, i.seconds_per_grid)
        for t, i, m in zip(got, items, req.media, strict=True)
    ]


def _next_hop(
    req: ProcessedRequest, encoded: EncodedMedia | None = None, kv: KvHandoff | None = None
) -> ProcessedRequest:
    # What this hop read is consumed: only what it made travels on.
    return msgspec.structs.replace(req, hop_index=req.hop_index + 1, encoded=encoded, kv=kv)


def _sampling(req: ProcessedRequest) -> SamplingConfig:
    s = req.request.sampling
    return SamplingConfig(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        seed=req.seed,
        min_tokens=s.min_tokens,
        ignore_eos=s.ignore_eos,
        max_tokens=req.max_tokens,
    )
