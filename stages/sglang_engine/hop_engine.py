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

Prefill and decode apart (E/P/D's ``prefill``, EP/D's ``encode+prefill``,
then ``decode``) move the KV cache by SGLang's own PD disaggregation: the
prefill worker's SGLang runs in ``prefill`` mode with a bootstrap server,
the decode worker's in ``decode`` mode, and one request goes to both with
the same room. SGLang's prefill waits until the decode engine asks for the
KV, so the prefill hop starts its request, hands the room to the decode
hop at once and lets the request run on past its own end (at most
``hand_off_ttl_s``). The decode engine makes every token, the first
included. What the decode hop cannot trust to be there (a redelivered
message, a takeover after tokens the prefill did not cover, a transfer
SGLang gave up on) sends the request back to its first hop (TensorGone),
whose prefill covers the prompt plus the tokens the client holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from schemas.errors import InvalidRequest, TensorGone
from schemas.processed import ProcessedRequest, SglangKv
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
    prompt_logprobs: list[Logprobs] | None = None
    # Prefill and decode apart: the prefill engine's bootstrap and the room.
    kv: SglangKv | None = None
    # A prefill hop's SGLang request, running on until the decode engine
    # has pulled its KV; set once the room went to the decode hop.
    prefill_task: asyncio.Task[None] | None = None
    handed_off: bool = False


class SglangHopEngine:
    # How long a prefill hop's SGLang request waits for the decode engine to
    # pull its KV before it is aborted (the tensor transport's TTL).
    hand_off_ttl_s = 60.0

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
        # Prefill requests handed off and still running (kept referenced).
        self._handed_off: set[asyncio.Task[None]] = set()
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
        for task in list(self._handed_off):
            task.cancel()
        if self.encoder is not None:
            await self.encoder.fetcher.close()
            self.encoder.close()
            self.encoder.thread.close()
        self.engine.close()

    async def health(self) -> None:
        await self.engine.check_health()

    @property
    def canary_runs(self) -> bool:
        # SGLang's prefill or decode engine alone takes only requests with a room.
        return self.engine.disaggregation is None

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

    # SGLang's own (return_logprob), by generated index on the handle.
    supports_logprobs = True
    engine_flag = "--engine sglang"  # named in what it refuses

    def logprobs(self, handle: SglangPrefilled, index: int) -> Logprobs | None:
        return handle.logprobs.get(index)

    def prompt_logprobs(self, handle: SglangPrefilled) -> list[Logprobs] | None:
        return handle.prompt_logprobs

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
        if req.request.sampling.prompt_logprobs is not None and self.engine.disaggregation is not None:
            raise InvalidRequest(
                "the prompt's logprobs (echo with logprobs) on --engine sglang need a worker that prefills and decodes"
            )
        sampling_params(sampling(req, len(ctx.emitted)))  # what SGLang cannot take: refused before anything runs
        length = check_context(req, media, self.max_model_len)
        handle = SglangPrefilled(req.request.request_id, length, self._prompt_ids(req, media, ctx), media)
        if self.engine.disaggregation == "prefill":
            # SGLang's prefill runs once the decode engine asks for its KV:
            # started here, it runs on past this hop (hand_off, abort).
            handle.kv = self.engine.bootstrap(random.getrandbits(63), len(ctx.emitted))
            handle.sglang_id = f"{handle.request_id}-p{uuid.uuid4().hex[:8]}"
            handle.prefill_task = asyncio.create_task(self._prefill(handle, sampling(req, len(ctx.emitted))))
        return handle

    async def _prefill(self, handle: SglangPrefilled, config: SamplingConfig) -> None:
        """A prefill hop's SGLang request, to its end: its one token (the
        decode engine makes it again) is dropped; SGLang ends the request
        once the decode engine has pulled the KV."""
        assert handle.sglang_id is not None and handle.kv is not None
        try:
            async with asyncio.timeout(self.hand_off_ttl_s):
                stream = self.engine.stream(handle.sglang_id, handle.prompt_ids, handle.media, config, handle.kv)
                async with contextlib.aclosing(stream) as deltas:
                    async for delta in deltas:
                        handle.finished = delta.finished
                        if delta.cached_tokens is not None:
                            handle.cached_tokens = delta.cached_tokens
                        if delta.aborted is not None:
                            log.warning("sglang_prefill_aborted", request_id=handle.request_id, why=delta.aborted)
        except TimeoutError:
            log.warning("sglang_prefill_unclaimed", request_id=handle.request_id, room=handle.kv.room)
        except InvalidRequest as exc:
            log.warning("sglang_prefill_refused", request_id=handle.request_id, error=exc.message)
        finally:
            if not handle.finished:
                handle.finished = True
                self.engine.abort(handle.sglang_id)

    def first_token(self, handle: SglangPrefilled) -> int | None:
        return None  # decode() gives every token, the first included

    async def hand_off(self, handle: SglangPrefilled, req: ProcessedRequest, ctx: HopContext) -> Carried:
        """The room and the prefill's bootstrap, and the media the decode
        engine needs again (SGLang places Qwen-VL's positions by them)."""
        assert handle.kv is not None and handle.prefill_task is not None, f"role {self.role} does not hand off"
        if handle.prefill_task.done():
            # Refused or failed before any decode engine could ask: nothing to hand on.
            raise InvalidRequest(f"SGLang's prefill of {handle.request_id} ended before its hand-off")
        encoded = await put_media(self.tensors, handle.media, req, ctx) if handle.media else None
        handle.handed_off = True
        self._handed_off.add(handle.prefill_task)
        handle.prefill_task.add_done_callback(self._handed_off.discard)
        return Carried(encoded=encoded, sglang_kv=handle.kv)

    async def receive_prefilled(self, req: ProcessedRequest, ctx: HopContext) -> SglangPrefilled:
        kv = req.sglang_kv
        if kv is None:
            raise InvalidRequest(f"a request reached {self.role} without SGLang's prefill hand-off")
        rid = req.request.request_id
        if ctx.redelivered or kv.resumed != len(ctx.emitted):
            # The room's KV may be pulled already, or cover fewer tokens than
            # the client holds: only a new prefill is sure.
            raise TensorGone(f"{rid}: SGLang's prefill KV (room {kv.room}) cannot be reused after a takeover")
        media = await self.receive_media(req, ctx)
        length = check_context(req, media, self.max_model_len)
        return SglangPrefilled(rid, length, self._prompt_ids(req, media, ctx), media, kv=kv)

    def _prompt_ids(self, req: ProcessedRequest, media: list[MediaEmbedding], ctx: HopContext) -> list[int]:
        """What SGLang gets: the prompt with each media item's placeholders
        expanded, then the tokens the client already holds."""
        try:
            expanded = self.family.expand_placeholders(req.prompt_token_ids, media)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        return [*expanded, *ctx.emitted]

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
        yielded = 0
        stream = self.engine.stream(handle.sglang_id, handle.prompt_ids, handle.media, config, handle.kv)
        async with contextlib.aclosing(stream) as deltas:
            async for delta in deltas:
                handle.finished = delta.finished
                if first and delta.cached_tokens is not None:
                    handle.cached_tokens = delta.cached_tokens
                    first = False
                if delta.prompt_logprobs is not None:  # asked for only before any token went out
                    handle.prompt_logprobs = delta.prompt_logprobs
                if delta.aborted is not None and handle.kv is not None and not yielded and not delta.token_ids:
                    # The KV never came (its prefill worker gone, the room unclaimed too long).
                    raise TensorGone(f"{handle.request_id}: SGLang's KV transfer failed: {delta.aborted}")
                for i, token in enumerate(delta.token_ids):
                    if delta.logprobs is not None and i < len(delta.logprobs):
                        handle.logprobs[len(ctx.emitted) + yielded] = delta.logprobs[i]
                    yielded += 1
                    yield token

    async def abort(self, handle: SglangPrefilled) -> None:
        if handle.prefill_task is not None:
            if not handle.handed_off:  # the hop ended before the room went on
                handle.prefill_task.cancel()
            return
        if handle.sglang_id is not None and not handle.finished:
            handle.finished = True
            self.engine.abort(handle.sglang_id)
            log.info("sglang_request_aborted", request_id=handle.request_id, sglang_request_id=handle.sglang_id)
