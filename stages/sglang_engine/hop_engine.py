"""SGLang behind the ``HopEngine`` interface (``--engine sglang``).

The same messages, route and reply stream as the built-in engine, for the
roles that prefill and decode in one worker:

- ``encode+prefill+decode`` (EPD): mmpipe's encoder (the checkpoint's own
  vision tower on torch, with the embedding cache) turns the request's
  images into embeddings; ``prefill+decode`` (E/PD): they come from an
  encode hop through the tensor transport. SGLang gets them as its
  ``processor_output`` input beside the prompt with each image's
  placeholders expanded (engine.py says why).
- A takeover resumes as the built-in engine does: the prompt plus the
  tokens the client already holds is the new prompt, no token the client
  saw is sent again. Each attempt is an SGLang request of its own id.
- A cancel, a stop string or a client gone aborts the SGLang request:
  ``abort()`` after every hop.

Prefill and decode apart (E/P/D, EP/D) would move the KV cache by SGLang's
own PD disaggregation (its Mooncake or NIXL transfer engines, which need a
GPU and RDMA): not here yet.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from schemas.errors import InvalidRequest
from schemas.processed import ProcessedRequest
from schemas.routes import moves_tensors
from stages.contract import HopContext, TensorStore
from stages.encoder import MediaEncoder
from stages.families import MediaEmbedding, family_for_architecture
from stages.hop_engine import Carried, check_context, put_media, receive_embeddings, sampling
from stages.sampling import Logprobs, SamplingConfig
from stages.sglang_engine import SGLANG_ROLES
from stages.sglang_engine.engine import SglangEngine, sampling_params

log = structlog.get_logger(__name__)


@dataclass(eq=False)
class SglangPrefilled:
    request_id: str
    # The prompt's tokens, media expanded (the usage's prompt_tokens).
    prompt_len: int
    # What SGLang gets: the expanded prompt plus what the client holds.
    prompt_ids: list[int]
    media: list[MediaEmbedding]
    # SGLang's prefix cache hits, as its first output tells them.
    cached_tokens: int = 0
    # The SGLang request running for it, and whether SGLang has ended it.
    sglang_id: str | None = None
    finished: bool = False
    logprobs: dict[int, Logprobs] = field(default_factory=dict)


class SglangHopEngine:
    def __init__(
        self,
        role: str,
        engine: SglangEngine,
        tensors: TensorStore | None = None,
        encoder: MediaEncoder | None = None,
    ) -> None:
        if role not in SGLANG_ROLES:
            raise ValueError(f"the SGLang engine runs the roles {', '.join(SGLANG_ROLES)}, not {role}")
        if role.startswith("encode") != (encoder is not None):
            raise ValueError(f"role {role}: an encoder is needed exactly where the role encodes")
        if tensors is None and moves_tensors(role):
            raise ValueError(f"role {role} takes embeddings from another hop: it needs a tensor store")
        self.role = role
        self.engine = engine
        self.tensors = tensors
        self.encoder = encoder
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(engine.model_dir))
        architecture = (list(getattr(config, "architectures", None) or []) or [""])[0]
        # Only its placeholder expansion: the model runs in SGLang.
        self.family = family_for_architecture(architecture)(Path(engine.model_dir), config)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.engine.eos_token_ids

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    async def start(self) -> None:
        await self.engine.start()

    async def close(self) -> None:
        if self.encoder is not None:
            await self.encoder.fetcher.close()
            self.encoder.close()
            self.encoder.thread.close()
        self.engine.close()

    async def health(self) -> None:
        await self.engine.check_health()

    async def canary(self) -> None:
        """A tiny request through SGLang (a worker's canary health check)."""
        ids = list(self.tokenizer("ok")["input_ids"])[:4] or [0]
        rid = f"canary-{uuid.uuid4().hex[:12]}"
        finished = False
        try:
            async for delta in self.engine.stream(rid, ids, [], SamplingConfig(max_tokens=1)):
                finished = finished or delta.finished
        finally:
            if not finished:
                self.engine.abort(rid)

    def has_room(self) -> bool:
        # SGLang's scheduler queues what its KV pool cannot hold yet; the
        # worker's in-flight cap bounds what it is given.
        return True

    # Logprobs are not passed to SGLang yet (sampling refuses them).
    supports_logprobs = False
    engine_flag = "--engine sglang"  # named in what it refuses

    def logprobs(self, handle: SglangPrefilled, index: int) -> Logprobs | None:
        return None

    def prompt_logprobs(self, handle: SglangPrefilled) -> list[Logprobs] | None:
        return None

    # -- encode ---------------------------------------------------------------

    async def encode(self, req: ProcessedRequest, ctx: HopContext) -> list[MediaEmbedding]:
        assert self.encoder is not None, f"role {self.role} does not encode"
        return await self.encoder.encode(req, ctx)

    async def send_media(self, media: list[MediaEmbedding], req: ProcessedRequest, ctx: HopContext) -> Carried:
        return Carried(encoded=await put_media(self.tensors, media, req, ctx)) if media else Carried()

    async def receive_media(self, req: ProcessedRequest, ctx: HopContext) -> list[MediaEmbedding]:
        return await receive_embeddings(self.role, self.tensors, req, "cpu", ctx)

    # -- prefill and decode ---------------------------------------------------

    async def prefill(self, req: ProcessedRequest, media: list[MediaEmbedding], ctx: HopContext) -> SglangPrefilled:
        """SGLang prefills inside the decode request: here only what it gets."""
        if req.request.prompt_embeds is not None or req.lora:
            raise InvalidRequest("prompt_embeds and LoRA adapters are not passed to --engine sglang yet")
        if req.request.sampling.prompt_logprobs is not None:
            raise InvalidRequest("the prompt's logprobs are not given on --engine sglang yet")
        sampling_params(sampling(req, len(ctx.emitted)))  # what SGLang cannot take: refused before anything runs
        length = check_context(req, media, self.max_model_len)
        try:
            expanded = self.family.expand_placeholders(req.prompt_token_ids, media)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        return SglangPrefilled(req.request.request_id, length, [*expanded, *ctx.emitted], media)

    def first_token(self, handle: SglangPrefilled) -> int | None:
        return None  # decode() gives every token, the first included

    async def hand_off(self, handle: SglangPrefilled, req: ProcessedRequest, ctx: HopContext) -> Carried:
        raise InvalidRequest("prefill and decode apart are not run on --engine sglang yet")

    async def receive_prefilled(self, req: ProcessedRequest, ctx: HopContext) -> SglangPrefilled:
        raise InvalidRequest("prefill and decode apart are not run on --engine sglang yet")

    async def decode(
        self, handle: SglangPrefilled, req: ProcessedRequest, ctx: HopContext, is_eos: Callable[[int], bool]
    ) -> AsyncGenerator[int, None]:
        # SGLang stops at EOS (unless ignore_eos), its stop ids and max_tokens itself.
        handle.sglang_id = f"{handle.request_id}-{uuid.uuid4().hex[:8]}"
        config = sampling(req, len(ctx.emitted))
        log.info(
            "sglang_decode_started",
            request_id=handle.request_id,
            sglang_request_id=handle.sglang_id,
            resumed=len(ctx.emitted),
        )
        first = True
        stream = self.engine.stream(handle.sglang_id, handle.prompt_ids, handle.media, config)
        async with contextlib.aclosing(stream) as deltas:
            async for delta in deltas:
                handle.finished = delta.finished
                if first and delta.cached_tokens is not None:
                    handle.cached_tokens = delta.cached_tokens
                    first = False
                for token in delta.token_ids:
                    yield token

    async def abort(self, handle: SglangPrefilled) -> None:
        if handle.sglang_id is not None and not handle.finished:
            handle.finished = True
            self.engine.abort(handle.sglang_id)
            log.info("sglang_request_aborted", request_id=handle.request_id, sglang_request_id=handle.sglang_id)
