"""The hop stage of a role that prefills and/or decodes with vLLM.

The same messages, route and reply stream as the built-in ``HopStage``:

- ``encode+prefill+decode``: mmpipe's encoder (the checkpoint's own vision
  tower on torch, with the embedding cache and precomputed embeddings) turns
  the request's images into embeddings; ``prefill+decode``: they come from
  an encode hop through the tensor transport. Either way vLLM gets them as
  ``image_embeds`` + ``image_grid_thw`` beside the processor's prompt ids
  (one placeholder per image, expanded by vLLM).
- Tokens become ``TokenChunk``s with ``seq`` through the same
  ``ChunkEmitter`` (text, stop strings, finish, usage).
- A takeover resumes as the built-in engine does: the prompt plus the tokens
  the client already holds is the new prompt, and ``seq`` continues after
  them; no token the client saw is sent again or changed.
- A cancel (the worker cancels the request's task), a stop string, or a
  client gone aborts the vLLM request (``AsyncLLM.abort``).

Prefill and decode apart (``encode+prefill`` or ``prefill``, then
``decode``): the prompt's KV cache moves by vLLM's own KV connector
(ExampleConnector or NixlConnector; ``args.kv_transfer_config``), never
through mmpipe's tensor transport. The prefill engine runs the prompt (plus
what a client already holds) with a one-token budget and
``do_remote_decode``; the ``kv_transfer_params`` it returns ride in the
decode message (``VllmKv``), and the decode engine gets them back with the
same prompt. The prefill engine's one token is dropped: the decode engine
produces every token itself, the first one included, by computing only the
prompt's last position(s) over the transferred cache (vLLM's own P/D
proxy does the same). So the tokens a client sees all come from one engine
and one stream with ``seq`` from 0 (or after a takeover's tokens), none
twice and none lost, and the decode metrics show the prompt as
``external_kv_transfer`` tokens (``metrics``). The decode engine still
needs the prompt's images (vLLM places M-RoPE positions by their grids,
ExampleConnector keys the cache by their hashes, and recomputes a partial
last block): the prefill hop puts the embeddings it used in the tensor
store again for the decode hop. A decode of another prompt than the one
prefilled (a takeover after tokens were streamed) passes no
``kv_transfer_params`` and recomputes that prompt locally.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import msgspec
import structlog

from schemas.errors import ContextLengthExceeded, InvalidRequest
from schemas.processed import EncodedItem, EncodedMedia, ProcessedRequest, VllmKv
from schemas.request import GenerateRequest
from stages.contract import HopContext, StageOutput, TensorStore
from stages.emitter import ChunkEmitter
from stages.encoder import MediaEncoder
from stages.engine.sampling import SamplingConfig
from stages.families import MediaEmbedding
from stages.hop import receive_embeddings
from stages.media import EmbeddingCache, MediaFetcher, MediaPolicy
from stages.scheduler import EngineThread
from stages.vllm_engine.args import (
    KV_CONSUMER_ROLES,
    KV_PRODUCER_ROLES,
    VLLM_ROLES,
    KvConnectorSettings,
    kv_transfer_config,
)
from stages.vllm_engine.engine import VllmEngine
from stages.vllm_engine.media import ec_transfer_config, remote_media

log = structlog.get_logger(__name__)

# Families whose image embeddings vLLM takes as image_embeds + image_grid_thw.
_ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")


class VllmHopStage:
    input_type = ProcessedRequest
    resumes_stream = True
    # The encoder-cache folder a vLLM encode hop writes (--vllm-ec-path): set
    # where this engine is that connector's consumer.
    ec_path: str | None = None

    def __init__(
        self,
        role: str,
        engine: VllmEngine,
        served_name: str,
        tensors: TensorStore | None = None,
        encoder: MediaEncoder | None = None,
    ) -> None:
        if role not in VLLM_ROLES:
            raise ValueError(f"the vLLM engine runs the roles {', '.join(VLLM_ROLES)}, not {role}")
        if role.startswith("encode") != (encoder is not None):
            raise ValueError(f"role {role}: an encoder is needed exactly where the role encodes")
        if encoder is None and tensors is None:
            raise ValueError(f"role {role} receives embeddings from an encode hop: it needs a tensor store")
        self.role = role
        self.engine = engine
        self.served_name = served_name
        self.tensors = tensors
        self.encoder = encoder

    @property
    def models(self) -> list[str]:
        return [self.served_name]

    async def start(self) -> None:
        await self.engine.start()

    async def health(self) -> None:
        """Raises where vLLM's engine core is gone: the worker is not ready."""
        await self.engine.check_health()

    async def close(self) -> None:
        if self.encoder is not None:
            await self.encoder.fetcher.close()
            self.encoder.thread.close()
        self.engine.close()

    async def run(
        self, message: GenerateRequest | ProcessedRequest, ctx: HopContext
    ) -> AsyncGenerator[StageOutput, None]:
        assert isinstance(message, ProcessedRequest)
        req = message
        started = time.monotonic()
        if self.encoder is not None:
            media = await self.encoder.encode(req, ctx)
        elif req.vllm_encoded is not None:  # a vLLM encode hop's: in the EC connector's folder
            media = remote_media(req, self.ec_path)
        else:
            media = await receive_embeddings(self.role, self.tensors, req, "cpu", ctx)
        if self.role in KV_PRODUCER_ROLES:
            yield await self._prefill(req, media, ctx, started)
            return
        kv_params: dict[str, Any] | None = None
        if self.role in KV_CONSUMER_ROLES:
            if req.vllm_kv is None:
                raise InvalidRequest(f"a request reached {self.role} without the vLLM prefill's KV hand-off")
            # Only the prompt prefilled has its cache there (see above).
            same_prompt = req.vllm_kv.resumed == len(ctx.emitted)
            kv_params = req.vllm_kv.params if same_prompt else None
            log.info("vllm_decode_started", request_id=req.request.request_id, resumed=len(ctx.emitted), kv=same_prompt)
        prompt_len = self._check_context(req, media)
        emitted = ctx.emitted
        emitter = ChunkEmitter(self.engine, req, prompt_len, emitted)
        if len(emitted) >= req.max_tokens:
            yield emitter.finish_now()
            return
        async for chunk in self._generate(req, media, emitter, emitted, ctx, started, kv_params):
            yield chunk

    async def _prefill(
        self, req: ProcessedRequest, media: list[MediaEmbedding], ctx: HopContext, started: float
    ) -> ProcessedRequest:
        """Prefill for a decode hop: the KV cache stays with vLLM's connector;
        the embeddings go on to decode through the tensor store."""
        rid = req.request.request_id
        emitted = ctx.emitted
        self._check_context(req, media)
        vllm_id = f"{rid}-{uuid.uuid4().hex[:8]}"
        done = False
        try:
            params = await self.engine.prefill(
                vllm_id, [*req.prompt_token_ids, *emitted], media, _sampling(req, len(emitted))
            )
            done = True
        finally:
            if not done:
                await self._abort(rid, vllm_id)
        ctx.trace["prefill_s"] = time.monotonic() - started
        encoded = None
        if media:
            assert self.tensors is not None
            ref = await self.tensors.put([m.embeddings for m in media], owner=rid)
            ctx.trace["put_bytes"] = float(ref.nbytes)
            items = [EncodedItem(m.num_tokens, list(m.grid_thw), m.seconds_per_grid) for m in media]
            encoded = EncodedMedia(ref, items)
        log.info("vllm_prefilled", request_id=rid, vllm_request_id=vllm_id, kv_params=sorted(params))
        return msgspec.structs.replace(
            req,
            hop_index=req.hop_index + 1,
            encoded=encoded,
            kv=None,
            vllm_kv=VllmKv(params=params, resumed=len(emitted)),
        )

    def _check_context(self, req: ProcessedRequest, media: list[MediaEmbedding]) -> int:
        prompt_len = len(req.prompt_token_ids) + sum(m.num_tokens - 1 for m in media)
        if prompt_len + req.max_tokens > self.engine.max_model_len:
            raise ContextLengthExceeded(
                f"a prompt of {prompt_len} tokens plus max_tokens {req.max_tokens} exceeds the context of "
                f"{self.engine.max_model_len} tokens"
            )
        return prompt_len

    async def _abort(self, rid: str, vllm_id: str) -> None:
        await self.engine.abort(vllm_id)
        log.info(
            "vllm_request_aborted",
            request_id=rid,
            vllm_request_id=vllm_id,
            role=self.role,
            unfinished=self.engine.unfinished,
        )

    async def _generate(
        self,
        req: ProcessedRequest,
        media: list[MediaEmbedding],
        emitter: ChunkEmitter,
        emitted: list[int],
        ctx: HopContext,
        started: float,
        kv_params: dict[str, Any] | None = None,
    ) -> AsyncGenerator[StageOutput, None]:
        rid = req.request.request_id
        # Unique per attempt: a takeover on this worker never meets an older
        # vLLM request of the same mmpipe request.
        vllm_id = f"{rid}-{uuid.uuid4().hex[:8]}"
        sampling = _sampling(req, len(emitted))
        finished = False  # vLLM has ended the request on its own
        first = True
        try:
            # Resume rule: what the client holds is part of the prompt now.
            stream = self.engine.stream(vllm_id, [*req.prompt_token_ids, *emitted], media, sampling, kv_params)
            async with contextlib.aclosing(stream) as deltas:
                async for delta in deltas:
                    finished = delta.finished
                    if first and delta.token_ids:
                        ctx.trace["prefill_s"] = time.monotonic() - started
                        first = False
                    for token in delta.token_ids:
                        chunk = emitter.push(token)
                        yield chunk
                        if chunk.finish_reason is not None:
                            return
            if not finished:
                return
            # vLLM ended it for a reason of its own (its context): close the stream.
            yield emitter.finish_now()
        finally:
            if not finished:
                await self._abort(rid, vllm_id)


def _sampling(req: ProcessedRequest, resumed: int) -> SamplingConfig:
    s = req.request.sampling
    return SamplingConfig(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        seed=req.seed,
        min_tokens=max(s.min_tokens - resumed, 0),
        ignore_eos=s.ignore_eos,
        max_tokens=req.max_tokens - resumed,
    )


def build_vllm_stage(
    role: str,
    model_dir: Path,
    served_name: str,
    engine_args: dict[str, Any],
    tensors: TensorStore | None = None,
    device: str = "cpu",
    media_policy: MediaPolicy | None = None,
    embedding_cache: EmbeddingCache | None = None,
    kv: KvConnectorSettings | None = None,
    ec_path: str = "",
) -> VllmHopStage:
    """A vLLM stage of ``role``; the engine itself starts in ``start()``.
    A role that encodes also loads the checkpoint on torch for its encoder."""
    from transformers import AutoConfig

    architectures = list(getattr(AutoConfig.from_pretrained(str(model_dir)), "architectures", None) or [])
    if not set(architectures) & set(_ARCHITECTURES):
        raise ValueError(
            f"the vLLM engine serves {', '.join(_ARCHITECTURES)} checkpoints so far; {model_dir} is {architectures}"
        )
    kv = kv or KvConnectorSettings()
    transfer = kv_transfer_config(role, kv)
    if transfer is not None and "kv_transfer_config" not in engine_args:  # --vllm-arg wins
        engine_args = {**engine_args, "kv_transfer_config": transfer}
    if ec_path and not role.startswith("encode") and "ec_transfer_config" not in engine_args:
        # The consumer of a vLLM encode hop's encoder outputs (built-in encode
        # hops' embeddings still come as image_embeds beside them).
        engine_args = {**engine_args, "ec_transfer_config": ec_transfer_config(False, ec_path)}
    engine = VllmEngine(model_dir, engine_args, role=role, kv=kv)
    encoder = None
    if role.startswith("encode"):
        from stages.engine import DecodeSettings, TorchEngine

        torch_engine = TorchEngine(model_dir, device=device, decode=DecodeSettings(batched=False))
        policy = media_policy or MediaPolicy()
        encoder = MediaEncoder(torch_engine, EngineThread(), MediaFetcher(policy), policy, embedding_cache)
    stage = VllmHopStage(role, engine, served_name, tensors, encoder)
    stage.ec_path = ec_path or None
    return stage


__all__ = ["VllmHopStage", "build_vllm_stage"]
