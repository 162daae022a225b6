"""Cache-aware routing (``--router kv``) with real workers: each later turn
of a conversation goes to the worker whose prefix cache holds its earlier
turns (every worker relays its KV events on NATS, the router indexes
them), tokens stay exactly generate()'s, and a hop sent to one worker
that does not take it goes back to the shared queue."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from pipeline.config import PipelineConfig, RouterSettings
from pipeline.router.router import DECISIONS
from stages.models import ModelSpec
from tests.e2e.conftest import client, gradient, png_data_url, start_stack
from tests.polling import eventually

N = 4
CONVERSATIONS = 6


def _conversation(seed: int) -> list[dict[str, Any]]:
    image = gradient(64, 48, seed)
    history = f"Conversation {seed}: we talked about the sea and the mountains for a long while. " * 4
    return [
        {"type": "text", "text": history},
        {"type": "image_url", "image_url": {"url": png_data_url(image)}},
        {"type": "text", "text": "What is in the picture?"},
    ]


async def _turn(c: Any, messages: list[dict[str, Any]]) -> tuple[str, int, int]:
    r = await c.chat.completions.create(
        model="tiny-qwen2-vl", messages=messages, max_tokens=N, temperature=0, extra_body={"min_tokens": N}
    )
    usage = r.usage
    return r.choices[0].message.content or "", usage.prompt_tokens, int(usage.prompt_tokens_details.cached_tokens)


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["epd", "e-pd"])
async def test_each_later_turn_goes_to_the_worker_that_holds_its_prefix(
    pipeline_config: PipelineConfig, model_spec: ModelSpec, mode: str
) -> None:
    """Two workers that prefill; the router is the bridge (epd) or the
    encode worker (e-pd), which knows the media's token counts exactly."""
    config = dataclasses.replace(pipeline_config, mode=mode, router=RouterSettings(mode="kv"))
    prefill_role = "encode+prefill+decode" if mode == "epd" else "prefill+decode"
    stack, stop = await start_stack(config, model_spec, counts={prefill_role: 2}, bridge_processes=True)
    try:
        holders = [w for w in stack.workers if w.role == prefill_role]
        router = stack.bridge.router if mode == "epd" else next(w for w in stack.workers if w.role == "encode").router
        await eventually(lambda: all(router.alive(w.worker_id) for w in holders), within=10)

        def placed() -> float:
            return DECISIONS.labels(prefill_role, "worker")._value.get()

        before = placed()
        async with client(stack) as c:
            firsts = []
            for seed in range(CONVERSATIONS):
                messages = [{"role": "user", "content": _conversation(seed)}]
                text, prompt, cached = await _turn(c, messages)
                # At most the chat template's system prompt, shared by every conversation.
                assert cached <= 16
                firsts.append((messages, text, prompt))
            # Each worker relayed what it cached: the router knows where each conversation is.
            await eventually(
                lambda: sum(router.index.blocks_of(w.worker_id) for w in holders) >= CONVERSATIONS * 4, within=10
            )
            for messages, text, prompt in firsts:
                messages += [
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": "And what else do you see?"},
                ]
                _, prompt2, cached = await _turn(c, messages)
                # The whole first prompt but its last block (or less) came from the cache.
                assert cached >= prompt - 16 - 1, (cached, prompt, prompt2)
        # Placed by the router, each of them: not a shared queue's luck.
        assert placed() - before >= CONVERSATIONS
    finally:
        await stop()
