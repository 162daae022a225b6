"""A hop: one or more contiguous steps of encode → prefill → decode, on any
engine.

Every worker role is a run of these steps (``encode``, ``prefill+decode``,
``encode+prefill+decode``, …). Steps inside one role hand their results over
in memory; at a role's end the engine says what the next hop needs
(``HopEngine.send_media``, ``hand_off``) and only that rides in the message:

- encode → prefill: the media embeddings (the built-in encoder's in the
  tensor store, ``EncodedMedia``; vLLM encoder-only's in its encoder-cache
  connector, ``VllmEncoded``);
- prefill → decode: the KV cache (the built-in engine's in the tensor
  store, ``KvHandoff``; vLLM's through its KV connector, ``VllmKv``).

The prefill step covers the prompt plus whatever a client already received
(a takeover), so decoding never re-emits or changes a token the client saw.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from schemas.chunk import TokenChunk
from schemas.errors import InvalidRequest
from schemas.processed import ProcessedRequest
from schemas.request import GenerateRequest
from schemas.routes import HOP_ROLES
from stages.contract import HopContext, StageOutput
from stages.emitter import ChunkEmitter
from stages.hop_engine import HopEngine, check_context

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

    def __init__(self, role: str, engine: HopEngine[Any], served_name: str) -> None:
        self.role = role
        self.steps = _Steps.of(role)
        # A role that prefills or decodes continues what a client may hold.
        self.resumes_stream = self.steps.prefill or self.steps.decode
        self.engine = engine
        self.served_name = served_name
        # The worker's canary health check: a tiny request through the engine, where it runs one.
        self.canary: Callable[[], Awaitable[None]] | None = (
            getattr(engine, "canary", None) if getattr(engine, "canary_runs", True) else None
        )
        # Sleep mode (the device's memory lent back), where the engine has one.
        self.sleep: Callable[[int], Awaitable[dict[str, int]]] | None = getattr(engine, "sleep", None)
        self.wake_up: Callable[[], Awaitable[None]] | None = getattr(engine, "wake_up", None)
        self.held_bytes: Callable[[], dict[str, int]] | None = getattr(engine, "held_bytes", None)
        # LoRA adapters loaded at run time, where the engine takes them.
        self.load_lora: Callable[[str, str], Awaitable[None]] | None = getattr(engine, "load_lora", None)
        self.unload_lora: Callable[[str], Awaitable[None]] | None = getattr(engine, "unload_lora", None)
        self.loras: Callable[[], list[str]] | None = getattr(engine, "loras", None)
        # A router may send it requests past their encode hop (their media's tokens in its prefix cache).
        self.takes_cached_media: bool = bool(getattr(engine, "takes_cached_media", False))

    @property
    def models(self) -> list[str]:
        """The model it serves, and the LoRA adapters its engine holds."""
        return [self.served_name, *(self.loras() if self.loras is not None else [])]

    async def start(self) -> None:
        await self.engine.start()

    async def health(self) -> None:
        """Raises where the engine can serve no more: the worker is not ready."""
        await self.engine.health()

    def has_room(self) -> bool:
        return self.engine.has_room()

    def kv_usage(self) -> tuple[int, int]:
        """KV blocks running sequences hold, of the pool's (0, 0: not known)."""
        usage = getattr(self.engine, "kv_usage", None)
        return usage() if usage is not None else (0, 0)

    async def reset_prefix_cache(self) -> int | None:
        """Forget the engine's cached prefixes: blocks forgotten, or None
        where the engine keeps none it can forget."""
        reset = getattr(self.engine, "reset_prefix_cache", None)
        return None if reset is None else await reset()

    async def close(self) -> None:
        await self.engine.close()

    async def run(
        self, message: GenerateRequest | ProcessedRequest, ctx: HopContext
    ) -> AsyncGenerator[StageOutput, None]:
        assert isinstance(message, ProcessedRequest)
        req = message
        engine = self.engine
        asked = req.request.sampling
        if (asked.logprobs is not None or asked.prompt_logprobs is not None) and not engine.supports_logprobs:
            raise InvalidRequest(f"logprobs are not available with {getattr(engine, 'engine_flag', 'this engine')}")
        if self.steps.encode or self.steps.prefill:
            media = await (engine.encode(req, ctx) if self.steps.encode else engine.receive_media(req, ctx))
            if not self.steps.prefill:
                yield (await engine.send_media(media, req, ctx)).next_hop(req)
                return
            check_context(req, media, engine.max_model_len)
            handle = await engine.prefill(req, media, ctx)
        else:
            handle = await engine.receive_prefilled(req, ctx)
        try:
            if not self.steps.decode:
                async for out in self._hand_off(req, handle, ctx):
                    yield out
                return
            async for chunk in self._decode(req, handle, ctx):
                yield chunk
        finally:
            await engine.abort(handle)

    async def _hand_off(self, req: ProcessedRequest, handle: Any, ctx: HopContext) -> AsyncGenerator[StageOutput, None]:
        """A hop that ends at prefill: the token its prefill chose goes to
        the client now (the first token does not wait for the KV hand-off and
        the decode hop's queue), then the sequence goes to the decode hop. A
        request that this token ends never reaches it."""
        emitted = ctx.emitted
        first = self.engine.first_token(handle)
        if first is not None:
            emitter = ChunkEmitter(self.engine, req, handle.prompt_len, emitted, lambda: handle.cached_tokens)
            chunk = (
                emitter.finish_now()
                if len(emitted) >= req.max_tokens
                else emitter.push(
                    first, self.engine.logprobs(handle, len(emitted)), self.engine.prompt_logprobs(handle)
                )
            )
            if chunk.finish_reason is not None:
                async for out in self._finish(req, emitter, chunk):
                    yield out
                return
            yield chunk
            emitted = [*emitted, first]
        yield (await self.engine.hand_off(handle, req, ctx)).next_hop(req, emitted)

    async def _decode(self, req: ProcessedRequest, handle: Any, ctx: HopContext) -> AsyncGenerator[StageOutput, None]:
        emitted = ctx.emitted
        emitter = ChunkEmitter(self.engine, req, handle.prompt_len, emitted, lambda: handle.cached_tokens)
        if len(emitted) >= req.max_tokens:
            async for out in self._finish(req, emitter, emitter.finish_now()):
                yield out
            return
        async with contextlib.aclosing(self.engine.decode(handle, req, ctx, emitter.is_eos)) as tokens:
            async for token in tokens:
                chunk = emitter.push(
                    token, self.engine.logprobs(handle, emitter.index), self.engine.prompt_logprobs(handle)
                )
                if chunk.finish_reason is not None:
                    async for out in self._finish(req, emitter, chunk):
                        yield out
                    return
                yield chunk
        # The engine ended the sequence for a reason of its own (vLLM: its
        # context is full): the stream still gets its final chunk.
        async for out in self._finish(req, emitter, emitter.finish_now()):
            yield out

    async def _finish(
        self, req: ProcessedRequest, emitter: ChunkEmitter, last: TokenChunk
    ) -> AsyncGenerator[ProcessedRequest | TokenChunk, None]:
        """The text's last chunk; a stage after the text (an image to draw)
        is queued before it, so a worker lost between the two leaves a
        redelivery that queues it again (the same message id: one copy),
        never a finished text with nothing queued after it."""
        if (after := req.after_text(emitter.text)) is not None:
            yield after
        yield last
