"""The hop stage of a role that prefills and decodes with vLLM.

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
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import structlog

from schemas.errors import ContextLengthExceeded
from schemas.processed import ProcessedRequest
from schemas.request import GenerateRequest
from stages.contract import HopContext, StageOutput, TensorStore
from stages.emitter import ChunkEmitter
from stages.encoder import MediaEncoder
from stages.engine.sampling import SamplingConfig
from stages.families import MediaEmbedding
from stages.hop import receive_embeddings
from stages.media import EmbeddingCache, MediaFetcher, MediaPolicy
from stages.scheduler import EngineThread
from stages.vllm_engine.args import VLLM_ROLES
from stages.vllm_engine.engine import VllmEngine

log = structlog.get_logger(__name__)

# Families whose image embeddings vLLM takes as image_embeds + image_grid_thw.
_ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")


class VllmHopStage:
    input_type = ProcessedRequest
    resumes_stream = True

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
        else:
            media = await receive_embeddings(self.role, self.tensors, req, "cpu", ctx)
        prompt_len = len(req.prompt_token_ids) + sum(m.num_tokens - 1 for m in media)
        if prompt_len + req.max_tokens > self.engine.max_model_len:
            raise ContextLengthExceeded(
                f"a prompt of {prompt_len} tokens plus max_tokens {req.max_tokens} exceeds the context of "
                f"{self.engine.max_model_len} tokens"
            )
        emitted = ctx.emitted
        emitter = ChunkEmitter(self.engine, req, prompt_len, emitted)
        if len(emitted) >= req.max_tokens:
            yield emitter.finish_now()
            return
        async for chunk in self._generate(req, media, emitter, emitted, ctx, started):
            yield chunk

    async def _generate(
        self,
        req: ProcessedRequest,
        media: list[MediaEmbedding],
        emitter: ChunkEmitter,
        emitted: list[int],
        ctx: HopContext,
        started: float,
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
            stream = self.engine.stream(vllm_id, [*req.prompt_token_ids, *emitted], media, sampling)
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
                await self.engine.abort(vllm_id)
                log.info(
                    "vllm_request_aborted",
                    request_id=rid,
                    vllm_request_id=vllm_id,
                    role=self.role,
                    unfinished=self.engine.unfinished,
                )


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
) -> VllmHopStage:
    """A vLLM stage of ``role``; the engine itself starts in ``start()``.
    A role that encodes also loads the checkpoint on torch for its encoder."""
    from transformers import AutoConfig

    architectures = list(getattr(AutoConfig.from_pretrained(str(model_dir)), "architectures", None) or [])
    if not set(architectures) & set(_ARCHITECTURES):
        raise ValueError(
            f"the vLLM engine serves {', '.join(_ARCHITECTURES)} checkpoints so far; {model_dir} is {architectures}"
        )
    engine = VllmEngine(model_dir, engine_args)
    encoder = None
    if role.startswith("encode"):
        from stages.engine import DecodeSettings, TorchEngine

        torch_engine = TorchEngine(model_dir, device=device, decode=DecodeSettings(batched=False))
        policy = media_policy or MediaPolicy()
        encoder = MediaEncoder(torch_engine, EngineThread(), MediaFetcher(policy), policy, embedding_cache)
    return VllmHopStage(role, engine, served_name, tensors, encoder)


__all__ = ["VllmHopStage", "build_vllm_stage"]
