"""vLLM behind the ``HopEngine`` interface (``--engine vllm``).

The same messages, route and reply stream as the built-in engine:

- ``encode+prefill+decode`` / ``encode+prefill``: mmpipe's encoder (the
  checkpoint's own vision tower on torch, with the embedding cache and
  precomputed embeddings) turns the request's media into embeddings;
  ``prefill+decode`` / ``prefill`` / ``decode``: they come from an encode
  hop through the tensor transport. Either way vLLM gets them as
  ``image_embeds`` + ``image_grid_thw`` (videos likewise, audio as
  ``audio_embeds``: ``media.mm_prompt``) beside the processor's prompt ids
  (one placeholder per item, expanded by vLLM). From
  a vLLM encode hop (encoder-only, ``encoder_only``) only each item's hash
  and grid come (``VllmEncoded``): vLLM loads the encoder output itself.
- A takeover resumes as the built-in engine does: the prompt plus the tokens
  the client already holds is the new prompt; no token the client saw is
  sent again or changed. Each attempt is a vLLM request of its own id, so a
  takeover on this worker never meets an older vLLM request of the same
  mmpipe request.
- A cancel, a stop string, or a client gone aborts the vLLM request
  (``AsyncLLM.abort``): ``abort()`` after every hop.

Prefill and decode apart (``encode+prefill`` or ``prefill``, then
``decode``): the prompt's KV cache moves by vLLM's own KV connector
(ExampleConnector or NixlConnector; ``args.kv_transfer_config``), never
through mmpipe's tensor transport. The prefill engine runs the prompt (plus
what a client already holds) with a one-token budget and
``do_remote_decode``; the ``kv_transfer_params`` it returns ride in the
decode message (``VllmKv``), and the decode engine gets them back with the
same prompt. The prefill engine's one token is dropped: the decode engine
produces every token itself, the first one included, by computing only the
prompt's last position(s) over the transferred cache (vLLM's own P/D proxy
does the same). So the tokens a client sees all come from one engine and
one stream, none twice and none lost, and the decode metrics show the
prompt as ``external_kv_transfer`` tokens (``metrics``). The decode engine
still needs the prompt's images (vLLM places M-RoPE positions by their
grids, ExampleConnector keys the cache by their hashes, and recomputes a
partial last block): the prefill hop puts the embeddings it used in the
tensor store again for the decode hop. A decode of another prompt than the
one prefilled (a takeover after tokens were streamed) passes no
``kv_transfer_params`` and recomputes that prompt locally.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog
import torch

from schemas.errors import InvalidRequest
from schemas.processed import EncodedItem, ProcessedRequest, VllmEncoded, VllmKv
from schemas.routes import moves_tensors
from stages.contract import HopContext, TensorStore
from stages.encoder import MediaEncoder
from stages.families import MediaEmbedding
from stages.hop_engine import Carried, check_context, prompt_len, put_media, receive_embeddings, sampling
from stages.media import MediaFetcher
from stages.prefix_keys import PromptMedia
from stages.prompt_embeds import load_prompt_embeds
from stages.sampling import Logprobs, SamplingConfig
from stages.vllm_engine.args import KV_PRODUCER_ROLES, VLLM_ROLES
from stages.vllm_engine.block_keys import VllmBlockKeys
from stages.vllm_engine.engine import VllmEngine
from stages.vllm_engine.media import RemoteEmbedding, remote_media

log = structlog.get_logger(__name__)


class Encoder(Protocol):
    """An encode step: mmpipe's ``MediaEncoder`` or vLLM encoder-only's."""

    fetcher: MediaFetcher

    async def encode(self, req: ProcessedRequest, ctx: HopContext) -> list[MediaEmbedding]: ...


@dataclass(eq=False)
class VllmPrefilled:
    request_id: str
    prompt_len: int
    # The prompt vLLM gets: the processor's ids plus what the client holds.
    prompt_ids: list[int]
    media: list[MediaEmbedding]
    # vLLM's prefix cache hits, as its first output tells them.
    cached_tokens: int = 0
    # When the prefill (or, on a decode hop, the decode) began: prefill_s
    # runs from here to the first token.
    started: float = field(default_factory=time.monotonic)
    # A prefill hop's: what vLLM's KV producer returned for the decode hop.
    # A decode hop's: what it hands back to vLLM (None: recompute the prompt).
    kv_params: dict[str, Any] | None = None
    # The vLLM request running for it, and whether vLLM has ended it.
    vllm_id: str | None = None
    finished: bool = False
    # Tokens decode() gave, and their logprobs by generated index (where asked for).
    yielded: int = 0
    logprobs: dict[int, Logprobs] = field(default_factory=dict)
    prompt_logprobs: list[Logprobs] | None = None
    # The prompt as input embeddings (``prompt_embeds``), where the request gave them.
    embeds: torch.Tensor | None = None


class VllmHopEngine:
    def __init__(
        self,
        role: str,
        llm: VllmEngine,
        tensors: TensorStore | None = None,
        encoder: Encoder | None = None,
        ec_path: str | None = None,
    ) -> None:
        if role not in VLLM_ROLES and role != "encode":
            raise ValueError(f"the vLLM engine runs the roles encode, {', '.join(VLLM_ROLES)}, not {role}")
        if role.startswith("encode") != (encoder is not None):
            raise ValueError(f"role {role}: an encoder is needed exactly where the role encodes")
        # vLLM encoder-only hands its outputs over by its own connector.
        if tensors is None and moves_tensors(role) and role != "encode":
            raise ValueError(f"role {role} hands embeddings to or from another hop: it needs a tensor store")
        self.role = role
        self.llm = llm
        self.tensors = tensors
        self.encoder = encoder
        # The encoder-cache folder a vLLM encode hop writes (--vllm-ec-path):
        # set where this engine is that connector's consumer.
        self.ec_path = ec_path
        # vLLM's block hashes rewritten as mmpipe's keys in the KV events a worker relays.
        self.block_keys = VllmBlockKeys()
        # LoRA adapters this worker serves (loaded into vLLM where it runs the language model).
        self._loras: set[str] = set()

    @property
    def tokenizer(self) -> Any:
        return self.llm.tokenizer

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.llm.eos_token_ids

    @property
    def max_model_len(self) -> int:
        return self.llm.max_model_len

    async def start(self) -> None:
        await self.llm.start()

    async def close(self) -> None:
        if self.encoder is not None:
            await self.encoder.fetcher.close()
        if isinstance(self.encoder, MediaEncoder):  # the torch vision tower beside vLLM: its own thread
            self.encoder.close()
            self.encoder.thread.close()
        self.llm.close()

    async def health(self) -> None:
        """Raises where vLLM's engine core is gone."""
        await self.llm.check_health()

    @property
    def canary_runs(self) -> bool:
        """An encode role's vLLM holds no language model to push a canary through."""
        return self.role != "encode"

    async def canary(self) -> None:
        """A tiny request through vLLM's engine (a worker's canary health
        check): a few prompt tokens, one token generated, aborted if it is
        cut short (a timeout)."""
        ids = list(self.tokenizer("ok")["input_ids"])[:4] or [0]
        rid = f"canary-{uuid.uuid4().hex[:12]}"
        finished = False
        try:
            async for delta in self.llm.stream(rid, ids, [], SamplingConfig(max_tokens=1)):
                finished = finished or delta.finished
        finally:
            if not finished:
                await self.llm.abort(rid)

    def _embeds(self, req: ProcessedRequest, ctx: HopContext) -> torch.Tensor:
        """The request's prompt embeddings, for vLLM's ``enable_prompt_embeds``."""
        assert req.request.prompt_embeds is not None
        if self.role in KV_PRODUCER_ROLES:
            # vLLM's KV connectors key a prompt by its token ids, which embeddings do not have.
            raise InvalidRequest("prompt_embeds on --engine vllm need a worker that prefills and decodes")
        if not self.llm.args.get("enable_prompt_embeds"):
            raise InvalidRequest("prompt_embeds on --engine vllm need vLLM's: --vllm-arg enable_prompt_embeds=true")
        if req.request.sampling.prompt_logprobs is not None:
            raise InvalidRequest("the prompt's logprobs are not given for prompt_embeds on --engine vllm")
        if ctx.emitted:
            # vLLM takes a prompt as embeddings or as ids, not both: the tokens a client holds cannot follow it.
            raise InvalidRequest("a request of prompt_embeds cannot resume on --engine vllm after its first tokens")
        return load_prompt_embeds(req.request.prompt_embeds, self.llm.hidden_size)

    async def load_lora(self, name: str, path: str) -> None:
        """Load a LoRA adapter into vLLM (--vllm-arg enable_lora=true) for
        requests that name it. An encode role runs no language model: it
        only takes the adapter's requests."""
        if self.role != "encode":
            await self.llm.add_lora(name, path)
        self._loras.add(name)

    async def unload_lora(self, name: str) -> None:
        self._loras.discard(name)
        if self.role != "encode":
            await self.llm.remove_lora(name)

    def loras(self) -> list[str]:
        return sorted(self._loras)

    def has_room(self) -> bool:
        # vLLM's scheduler queues what its KV cache cannot hold yet; the
        # worker's in-flight cap bounds what it is given.
        return True

    # -- encode ---------------------------------------------------------------

    async def encode(self, req: ProcessedRequest, ctx: HopContext) -> list[MediaEmbedding]:
        assert self.encoder is not None, f"role {self.role} does not encode"
        return await self.encoder.encode(req, ctx)

    async def send_media(self, media: list[MediaEmbedding], req: ProcessedRequest, ctx: HopContext) -> Carried:
        if not media:
            return Carried()
        if all(isinstance(m, RemoteEmbedding) for m in media):  # in the encoder-cache connector: keys only
            return Carried(vllm_encoded=_keys(media))
        return Carried(encoded=await put_media(self.tensors, media, req, ctx))

    async def receive_media(self, req: ProcessedRequest, ctx: HopContext) -> list[MediaEmbedding]:
        if req.vllm_encoded is not None:  # a vLLM encode hop's: in the EC connector's folder
            return remote_media(req, self.ec_path)
        return await receive_embeddings(self.role, self.tensors, req, "cpu", ctx)

    # -- prefill --------------------------------------------------------------

    async def prefill(self, req: ProcessedRequest, media: list[MediaEmbedding], ctx: HopContext) -> VllmPrefilled:
        """Where the role decodes too, vLLM prefills inside the decode
        request; for a decode hop, a one-token prefill whose KV cache vLLM's
        connector keeps for it."""
        rid = req.request.request_id
        handle = VllmPrefilled(rid, prompt_len(req, media), [*req.prompt_token_ids, *ctx.emitted], media)
        if req.request.prompt_embeds is not None:
            handle.embeds = self._embeds(req, ctx)
        items = zip(req.media, media, strict=True)
        self.block_keys.learn(
            handle.prompt_ids, [PromptMedia(m.placeholder_index, e.num_tokens, e.digest) for m, e in items]
        )
        if self.role not in KV_PRODUCER_ROLES:
            return handle
        if req.request.sampling.prompt_logprobs is not None:
            # The decode engine loads the prompt's cache: it never sees the prompt's logits.
            raise InvalidRequest(
                "the prompt's logprobs (echo with logprobs) on --engine vllm need a worker that prefills and decodes"
            )
        vllm_id = _vllm_id(rid)
        done = False
        try:
            handle.kv_params = await self.llm.prefill(
                vllm_id, handle.prompt_ids, media, sampling(req, len(ctx.emitted)), req.lora
            )
            done = True
        finally:
            if not done:
                await self._abort(rid, vllm_id)
        ctx.trace["prefill_s"] = time.monotonic() - handle.started
        log.info("vllm_prefilled", request_id=rid, vllm_request_id=vllm_id, kv_params=sorted(handle.kv_params))
        return handle

    # vLLM's own (SamplingParams.logprobs), by generated index on the handle.
    supports_logprobs = True

    def logprobs(self, handle: VllmPrefilled, index: int) -> Logprobs | None:
        return handle.logprobs.get(index)

    def prompt_logprobs(self, handle: VllmPrefilled) -> list[Logprobs] | None:
        return handle.prompt_logprobs

    def first_token(self, handle: VllmPrefilled) -> int | None:
        # vLLM's decode instance samples the token after the transferred
        # prompt itself (its KV connector moves the prompt's blocks only).
        return None

    async def hand_off(self, handle: VllmPrefilled, req: ProcessedRequest, ctx: HopContext) -> Carried:
        """The KV connector's params, and the media the decode engine needs
        again: embeddings through the tensor store, or (a vLLM encode hop's)
        the encoder-cache keys it read them by."""
        kv = VllmKv(params=handle.kv_params or {}, resumed=len(ctx.emitted))
        if handle.media and req.vllm_encoded is not None:
            return Carried(vllm_encoded=req.vllm_encoded, vllm_kv=kv)
        encoded = await put_media(self.tensors, handle.media, req, ctx) if handle.media else None
        return Carried(encoded=encoded, vllm_kv=kv)

    async def receive_prefilled(self, req: ProcessedRequest, ctx: HopContext) -> VllmPrefilled:
        media = await self.receive_media(req, ctx)
        if req.vllm_kv is None:
            raise InvalidRequest(f"a request reached {self.role} without the vLLM prefill's KV hand-off")
        # Only the prompt prefilled has its cache there (see above).
        same_prompt = req.vllm_kv.resumed == len(ctx.emitted)
        rid = req.request.request_id
        log.info("vllm_decode_started", request_id=rid, resumed=len(ctx.emitted), kv=same_prompt)
        return VllmPrefilled(
            rid,
            check_context(req, media, self.max_model_len),
            [*req.prompt_token_ids, *ctx.emitted],
            media,
            kv_params=req.vllm_kv.params if same_prompt else None,
        )

    # -- decode ---------------------------------------------------------------

    async def decode(
        self, handle: VllmPrefilled, req: ProcessedRequest, ctx: HopContext, is_eos: Callable[[int], bool]
    ) -> AsyncGenerator[int, None]:
        # vLLM stops at EOS (unless ignore_eos) and max_tokens itself: is_eos is not needed.
        handle.vllm_id = _vllm_id(handle.request_id)
        params = sampling(req, len(ctx.emitted))
        stream = self.llm.stream(
            handle.vllm_id, handle.prompt_ids, handle.media, params, handle.kv_params, req.lora, handle.embeds
        )
        first = True
        async with contextlib.aclosing(stream) as deltas:
            async for delta in deltas:
                handle.finished = delta.finished
                if delta.prompt_logprobs is not None:
                    handle.prompt_logprobs = delta.prompt_logprobs
                if delta.cached_tokens is not None:
                    handle.cached_tokens = delta.cached_tokens
                if first and delta.token_ids:
                    ctx.trace["prefill_s"] = time.monotonic() - handle.started
                    first = False
                for i, token in enumerate(delta.token_ids):
                    if delta.logprobs is not None:
                        handle.logprobs[len(ctx.emitted) + handle.yielded] = delta.logprobs[i]
                    handle.yielded += 1
                    yield token

    async def abort(self, handle: VllmPrefilled) -> None:
        if handle.vllm_id is not None and not handle.finished:
            handle.finished = True
            await self._abort(handle.request_id, handle.vllm_id)

    async def _abort(self, rid: str, vllm_id: str) -> None:
        await self.llm.abort(vllm_id)
        log.info(
            "vllm_request_aborted",
            request_id=rid,
            vllm_request_id=vllm_id,
            role=self.role,
            unfinished=self.llm.unfinished,
        )


def _vllm_id(rid: str, kind: str = "") -> str:
    """Unique per attempt: a takeover on this worker never meets an older
    vLLM request of the same mmpipe request."""
    return f"{rid}-{kind}{uuid.uuid4().hex[:8]}"


def _keys(media: list[MediaEmbedding]) -> VllmEncoded:
    remote = [m for m in media if isinstance(m, RemoteEmbedding)]
    return VllmEncoded(
        mm_hashes=[m.mm_hash for m in remote], items=[EncodedItem(m.num_tokens, list(m.grid_thw)) for m in remote]
    )
