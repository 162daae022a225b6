"""What a hop asks of an engine, whichever engine it is.

``HopStage`` (stages/hop.py) runs every hop role (``encode``, ``prefill``,
``decode`` and their ``+`` joins) through ``HopEngine`` alone; how a step is
done stays behind it:

- the built-in engine (``TorchHopEngine``, stages/torch_engine/hop_engine.py):
  mmpipe's encoder, prefill and continuous-batching decode on torch, tensors
  (media embeddings, KV cache) handed to the next hop by mmpipe's
  ``TensorStore``;
- vLLM (``VllmHopEngine``, stages/vllm_engine/hop_engine.py): ``AsyncLLM``,
  the KV cache moved by vLLM's own connector (``VllmKv`` in the message),
  images encoded by mmpipe's encoder or by vLLM encoder-only;
- SGLang (``SglangHopEngine``, stages/sglang_engine/hop_engine.py): its
  offline ``Engine``, the KV cache moved by its own PD disaggregation (the
  room and bootstrap in ``SglangKv``), images encoded by mmpipe's encoder.

A hop calls, in order: ``encode`` or ``receive_media``; then ``send_media``
(a role that only encodes), or ``prefill``; or, on a role that starts at
decode, ``receive_prefilled``; then ``hand_off`` (a role that ends at
prefill) or ``decode``; and ``abort`` once it is done with a prefilled
sequence, whatever happened. What the two engines share sits here too: the
context check, the sampling a request asks for, the tensor store's put and
get with their trace keys.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import msgspec
import torch

from schemas.errors import ContextLengthExceeded, InvalidRequest
from schemas.processed import EncodedItem, EncodedMedia, KvHandoff, ProcessedRequest, SglangKv, VllmEncoded, VllmKv
from schemas.tensors import TensorRef
from stages.contract import HopContext, TensorStore
from stages.families import MediaEmbedding
from stages.sampling import Logprobs, SamplingConfig


class Prefilled(Protocol):
    """A prefilled sequence as its engine holds it (or will make it)."""

    @property
    def prompt_len(self) -> int:
        """The prompt's length with each media placeholder counted as its
        tokens: what the usage reports."""
        ...

    @property
    def cached_tokens(self) -> int:
        """Of those, the ones whose keys and values came from a prefix cache."""
        ...


H = TypeVar("H", bound=Prefilled)


@dataclass(frozen=True)
class Carried:
    """What a hop made for the next one: the next message's tensor and
    hand-off fields. What the hop read is consumed, so a field it did not
    make travels on empty."""

    encoded: EncodedMedia | None = None
    kv: KvHandoff | None = None
    vllm_encoded: VllmEncoded | None = None
    vllm_kv: VllmKv | None = None
    sglang_kv: SglangKv | None = None

    def next_hop(self, req: ProcessedRequest, emitted: list[int] | None = None) -> ProcessedRequest:
        """``emitted``: the tokens the client holds now, where this hop streamed some."""
        return msgspec.structs.replace(
            req,
            hop_index=req.hop_index + 1,
            emitted=req.emitted if emitted is None else emitted,
            decoded=None,
            encoded=self.encoded,
            kv=self.kv,
            vllm_encoded=self.vllm_encoded,
            vllm_kv=self.vllm_kv,
            sglang_kv=self.sglang_kv,
        )


class HopEngine(Protocol[H]):
    """The steps of a hop on one engine. ``H`` is the engine's handle of a
    prefilled sequence. The engine is built for one role and one worker."""

    # What ChunkEmitter reads: text, EOS, and the context the check uses.
    @property
    def tokenizer(self) -> Any: ...

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    @property
    def max_model_len(self) -> int: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def health(self) -> None:
        """Raises where the engine can serve no more (the worker's readiness
        says ``engine_dead``)."""
        ...

    def has_room(self) -> bool:
        """Whether the worker should take another request now (False: its
        memory for sequences is spent; it fetches again once some leave)."""
        ...

    async def encode(self, req: ProcessedRequest, ctx: HopContext) -> list[MediaEmbedding]:
        """The request's media as embeddings, one per item (none for text)."""
        ...

    async def send_media(self, media: list[MediaEmbedding], req: ProcessedRequest, ctx: HopContext) -> Carried:
        """What a hop that only encodes gives the prefill hop."""
        ...

    async def receive_media(self, req: ProcessedRequest, ctx: HopContext) -> list[MediaEmbedding]:
        """What an encode hop sent (``send_media``), on a hop that prefills."""
        ...

    async def prefill(self, req: ProcessedRequest, media: list[MediaEmbedding], ctx: HopContext) -> H:
        """The prompt plus what the client already holds (``ctx.emitted``)."""
        ...

    def logprobs(self, handle: H, index: int) -> Logprobs | None:
        """The logprob of generated token ``index`` and the most likely
        tokens' at its step (``SamplingConfig.logprobs``); None where none
        were asked for, or the engine gives none."""
        ...

    def prompt_logprobs(self, handle: H) -> list[Logprobs] | None:
        """The prompt's logprobs, each token's after the first, with the most
        likely tokens' at its place (``SamplingConfig.prompt_logprobs``);
        None where none were asked for or a client already had the first chunk."""
        ...

    @property
    def supports_logprobs(self) -> bool:
        """Whether ``logprobs`` and ``prompt_logprobs`` answer: a request
        asking for them is refused otherwise."""
        ...

    def first_token(self, handle: H) -> int | None:
        """The token the prefill chose (after ``ctx.emitted``), which a hop
        that ends at prefill streams before it hands the sequence on; None
        where the engine's decode hop makes that token itself."""
        ...

    async def hand_off(self, handle: H, req: ProcessedRequest, ctx: HopContext) -> Carried:
        """What the decode hop needs of a prefilled sequence."""
        ...

    async def receive_prefilled(self, req: ProcessedRequest, ctx: HopContext) -> H:
        """A prefill hop's ``hand_off``, on a hop that starts at decode."""
        ...

    def decode(
        self, handle: H, req: ProcessedRequest, ctx: HopContext, is_eos: Callable[[int], bool]
    ) -> AsyncGenerator[int, None]:
        """The tokens after ``ctx.emitted``, up to ``req.max_tokens``, an EOS
        token (``is_eos``), or until the caller stops iterating (a stop
        string, a client gone)."""
        ...

    async def abort(self, handle: H) -> None:
        """Free what the engine still runs or holds for ``handle``: called
        once the hop is done with it (finished, failed or cancelled); does
        nothing where nothing is left."""
        ...


def prompt_len(req: ProcessedRequest, media: list[MediaEmbedding]) -> int:
    """The prompt's length with each placeholder expanded to its item's tokens."""
    return len(req.prompt_token_ids) + sum(m.num_tokens - 1 for m in media)


def check_context(req: ProcessedRequest, media: list[MediaEmbedding], max_model_len: int) -> int:
    """The expanded prompt length; raises where it and ``max_tokens`` do not
    fit the model's context (before any engine work)."""
    length = prompt_len(req, media)
    if length + req.max_tokens > max_model_len:
        raise ContextLengthExceeded(
            f"a prompt of {length} tokens plus max_tokens {req.max_tokens} exceeds the context of "
            f"{max_model_len} tokens"
        )
    return length


def sampling(req: ProcessedRequest, resumed: int = 0) -> SamplingConfig:
    """The request's sampling. ``resumed``: tokens a client already holds
    that the engine takes as prompt (vLLM), so fewer remain to generate; the
    built-in engine counts them as generated and passes 0."""
    s = req.request.sampling
    return SamplingConfig(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        seed=req.seed,
        min_tokens=max(s.min_tokens - resumed, 0),
        ignore_eos=s.ignore_eos,
        max_tokens=req.max_tokens - resumed,
        logprobs=s.logprobs,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        logit_bias=tuple(sorted(s.logit_bias.items())),
        repetition_penalty=s.repetition_penalty,
        min_p=s.min_p,
        stop_token_ids=tuple(s.stop_token_ids),
        structured=s.structured,
        # A resumed request's client has had the first chunk, and with it the prompt's.
        prompt_logprobs=s.prompt_logprobs if not resumed else None,
        # The prompt's distinct ids, which the repetition penalty covers: an
        # expanded media item repeats its placeholder's id, so the prompt as
        # sent names them all.
        # (None where the prompt came as embeddings: its ids are stand-ins.)
        prompt_ids=(
            tuple(sorted(set(req.prompt_token_ids)))
            if s.repetition_penalty != 1.0 and req.request.prompt_embeds is None
            else ()
        ),
    )


# -- the tensor store, with the seconds and bytes on the request's trace --------


async def put_tensors(store: TensorStore | None, tensors: list[torch.Tensor], owner: str, ctx: HopContext) -> TensorRef:
    assert store is not None, "a role that hands tensors on is built with a tensor store"
    with ctx.timed("put") as span:
        ref = await store.put(tensors, owner=owner)
        span.set_attribute("bytes", ref.nbytes)
    ctx.trace["put_bytes"] = float(ref.nbytes)
    return ref


async def get_tensors(
    store: TensorStore | None, ref: TensorRef, device: torch.device | str, ctx: HopContext
) -> list[torch.Tensor]:
    assert store is not None, "a role that takes tensors from another hop is built with a tensor store"
    with ctx.timed("get", bytes=ref.nbytes):
        out = await store.get(ref, device)
    ctx.trace["get_bytes"] = float(ref.nbytes)
    return out


async def get_tensors_into(
    store: TensorStore | None, ref: TensorRef, targets: list[torch.Tensor | list[torch.Tensor]], ctx: HopContext
) -> None:
    """``get_tensors`` into the caller's own tensors (``TensorStore.get_into``)."""
    assert store is not None, "a role that takes tensors from another hop is built with a tensor store"
    with ctx.timed("get", bytes=ref.nbytes):
        await store.get_into(ref, targets)
    ctx.trace["get_bytes"] = float(ref.nbytes)


async def put_media(
    store: TensorStore | None, media: list[MediaEmbedding], req: ProcessedRequest, ctx: HopContext
) -> EncodedMedia:
    """Embeddings for a later hop: one tensor per item, and what prefill
    needs of each besides."""
    ref = await put_tensors(store, [m.embeddings for m in media], req.request.request_id, ctx)
    items = [EncodedItem(m.num_tokens, list(m.grid_thw), m.seconds_per_grid, m.digest) for m in media]
    return EncodedMedia(ref, items)


async def receive_embeddings(
    role: str, store: TensorStore | None, req: ProcessedRequest, device: torch.device | str, ctx: HopContext
) -> list[MediaEmbedding]:
    """The embeddings an encode hop put for ``req``'s media (none for a text
    request)."""
    if not req.media:
        return []
    if req.encoded is None:
        raise InvalidRequest(f"a request with media reached {role} without its embeddings")
    got = await get_tensors(store, req.encoded.ref, device, ctx)
    items = req.encoded.items
    if len(got) != len(items) or len(items) != len(req.media):
        raise InvalidRequest(f"{len(got)} embeddings for {len(items)} encoded and {len(req.media)} media items")
    return [
        MediaEmbedding(t, tuple(i.grid_thw), m.kind, i.seconds_per_grid, i.digest)
        for t, i, m in zip(got, items, req.media, strict=True)
    ]


def client_ahead(output_ids: list[int], emitted: list[int]) -> bool:
    """Whether the client holds more than a prefilled sequence covers, or
    another token (a takeover raced an earlier attempt): its tokens then win."""
    return emitted[: len(output_ids)] != output_ids[: len(emitted)] or len(emitted) > len(output_ids)
