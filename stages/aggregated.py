"""The aggregated hop (``encode+prefill+decode``): media → embeddings →
prefill → decode, streaming token chunks. The steps are the engine's; this
module sequences them for one request and turns tokens into chunks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from schemas.chunk import FinishReason, TokenChunk, Usage
from schemas.errors import ContextLengthExceeded
from schemas.processed import ProcessedRequest
from schemas.request import GenerateRequest
from stages.contract import HopContext, StageOutput
from stages.detokenizer import IncrementalDetokenizer, StopStringMatcher
from stages.engine import SamplingConfig, TorchEngine
from stages.media import MediaFetcher, MediaPolicy, load_image
from stages.scheduler import DecodeScheduler, EngineThread


class AggregatedStage:
    role = "encode+prefill+decode"
    input_type = ProcessedRequest
    streams_tokens = True

    def __init__(
        self,
        engine: TorchEngine,
        served_name: str,
        media_policy: MediaPolicy | None = None,
        max_batch: int = 32,
    ) -> None:
        self.engine = engine
        self.served_name = served_name
        self.media_policy = media_policy or MediaPolicy()
        self.fetcher = MediaFetcher(self.media_policy)
        self.thread = EngineThread()
        self.scheduler = DecodeScheduler(engine, self.thread, max_batch=max_batch)

    @property
    def models(self) -> list[str]:
        return [self.served_name]

    async def start(self) -> None:
        self.scheduler.start()

    async def close(self) -> None:
        await self.scheduler.close()
        await self.fetcher.close()
        self.thread.close()

    async def run(
        self, message: GenerateRequest | ProcessedRequest, ctx: HopContext
    ) -> AsyncGenerator[StageOutput, None]:
        assert isinstance(message, ProcessedRequest)
        async for chunk in self.generate(message, ctx.emitted):
            yield chunk

    async def generate(self, req: ProcessedRequest, emitted: list[int]) -> AsyncIterator[TokenChunk]:
        images = await asyncio.gather(*(load_image(m.url, self.fetcher, self.media_policy) for m in req.media))
        encoded = await self.thread.call(self.engine.encode, list(images)) if images else []
        prompt_len = len(req.prompt_token_ids) + sum(e.num_tokens - 1 for e in encoded)
        if prompt_len + req.max_tokens > self.engine.max_model_len:
            raise ContextLengthExceeded(
                f"a prompt of {prompt_len} tokens plus max_tokens {req.max_tokens} exceeds the context of "
                f"{self.engine.max_model_len} tokens"
            )
        emitter = _ChunkEmitter(self.engine, req, prompt_len, emitted)
        if len(emitted) >= req.max_tokens:
            yield emitter.finish_now()
            return
        sampling = _sampling_config(req)
        seq, first = await self.thread.call_or_release(
            lambda out: self.engine.release(out[0]),
            lambda: self.engine.prefill([req.prompt_token_ids], [encoded], [sampling], [emitted])[0],
        )
        chunk = emitter.push(first)
        yield chunk
        if chunk.finish_reason is not None:
            self.thread.submit(self.engine.release, seq)
            return
        async for token in self.scheduler.stream(seq, emitter.is_last):
            chunk = emitter.push(token)
            yield chunk
            if chunk.finish_reason is not None:
                return


def _sampling_config(req: ProcessedRequest) -> SamplingConfig:
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


class _ChunkEmitter:
    """Tokens → chunks: ``seq``, text deltas, stop strings, finish, usage."""

    def __init__(self, engine: Any, req: ProcessedRequest, prompt_len: int, emitted: list[int]) -> None:
        self._eos = engine.eos_token_ids
        self._ignore_eos = req.request.sampling.ignore_eos
        self._max_tokens = req.max_tokens
        self._rid = req.request.request_id
        self._prompt_len = prompt_len
        self._detok = IncrementalDetokenizer(engine.tokenizer)
        # Primed with what an earlier attempt emitted: text it held back (a
        # character cut in half) comes out with the next token.
        for token in emitted:
            self._detok.push(token)
        self._stops = StopStringMatcher(req.request.sampling.stop)
        self.index = len(emitted)
        self._decoded = self.index + 1

    def is_last(self, token: int) -> bool:
        """Called by the decode loop, ahead of ``push``, for each token it
        produces: the first came from prefill, so the loop's count starts one on."""
        self._decoded += 1
        return self._is_eos(token) or self._decoded >= self._max_tokens

    def _is_eos(self, token: int) -> bool:
        return token in self._eos and not self._ignore_eos

    def push(self, token: int) -> TokenChunk:
        seq = self.index
        self.index += 1
        finish: FinishReason | None = None
        if self._is_eos(token):
            finish = FinishReason.STOP
        elif self.index >= self._max_tokens:
            finish = FinishReason.LENGTH
        text, hit_stop = self._stops.feed(self._detok.push(token))
        if hit_stop:
            finish = FinishReason.STOP
        elif finish is not None:
            more, hit_stop = self._stops.feed(self._detok.flush())
            text += more if hit_stop else more + self._stops.flush()
        return self._chunk(seq, [token], text, finish)

    def finish_now(self) -> TokenChunk:
        return self._chunk(self.index, [], self._stops.feed(self._detok.flush())[0], FinishReason.LENGTH)

    def _chunk(self, seq: int, tokens: list[int], text: str, finish: FinishReason | None) -> TokenChunk:
        usage = Usage(self._prompt_len, seq + len(tokens)) if finish is not None else None
        return TokenChunk(request_id=self._rid, seq=seq, token_ids=tokens, text=text, finish_reason=finish, usage=usage)
