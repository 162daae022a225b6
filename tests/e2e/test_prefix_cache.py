"""Prefix caching through the official openai client, in every mode: a
second turn that starts as the first reuses the KV blocks of the worker
that prefilled it, reports them as ``usage.prompt_tokens_details
.cached_tokens``, and still answers exactly as generate() does. Which
worker caches: the one that prefills, where it holds a KV pool (on a CPU
a prefill-only worker hands its cache on and keeps no pool)."""

from __future__ import annotations

from typing import Any

import aiohttp
import openai
import pytest

from pipeline.bridge.app import BridgeSettings
from pipeline.config import PipelineConfig
from schemas.routes import MODES
from stages.models import ModelSpec
from tests.e2e.conftest import Stack, ask, client, gradient, png_data_url, start_stack
from tests.e2e.test_modes import make_stack  # noqa: F401  (a fixture)

N = 6
BLOCK = 16


async def _cached(c: Any, content: Any, stream: bool) -> int:
    messages = [{"role": "user", "content": content}]
    if not stream:
        r = await c.chat.completions.create(
            model="tiny-qwen2-vl", messages=messages, max_tokens=N, temperature=0, extra_body={"min_tokens": N}
        )
        return int(r.usage.prompt_tokens_details.cached_tokens)
    s = await c.chat.completions.create(
        model="tiny-qwen2-vl",
        messages=messages,
        max_tokens=N,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"min_tokens": N},
    )
    cached = -1
    async for chunk in s:
        if chunk.usage:
            cached = int(chunk.usage.prompt_tokens_details.cached_tokens)
    return cached


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["epd", "e-pd", "e-p-d", "ep-d"])
async def test_a_second_turn_reuses_the_first_turns_blocks_and_says_so(
    make_stack: Any,  # noqa: F811
    reference: Any,
    mode: str,
) -> None:
    stack = await make_stack(mode)
    image = gradient(64, 48, 1)
    history = "We talked about the sea and the mountains for a long while. " * 6
    content = [
        {"type": "text", "text": history},
        {"type": "image_url", "image_url": {"url": png_data_url(image)}},
        {"type": "text", "text": "What is in the picture?"},
    ]
    _, expected = reference(content, [image], N)
    prefill_role = next(role for role in MODES[mode] if "prefill" in role)
    caches = "decode" in prefill_role  # on a CPU only a worker that decodes holds a pool
    async with client(stack) as c:
        assert await _cached(c, content, stream=True) == 0
        cached = await _cached(c, content, stream=False)
        assert (cached >= 4 * BLOCK) if caches else cached == 0
        assert cached % BLOCK == 0
        assert await ask(c, content, stream=True, n=N) == (expected, N)


@pytest.mark.e2e
async def test_the_bridges_cache_reset_makes_every_worker_forget_its_prefixes(
    pipeline_config: PipelineConfig, model_spec: ModelSpec
) -> None:
    """Behind the API key; each worker answers (one with no cache says so);
    the next same request prefills its whole prompt again."""
    config = PipelineConfig(nats_url=pipeline_config.nats_url, namespace=pipeline_config.namespace, mode="e-pd")
    stack, stop = await start_stack(config, model_spec, bridge_settings=BridgeSettings(port=0, api_key="k"))
    content = "Tell me about the sea and the mountains and the long way between them. " * 6
    try:
        keyed = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="k", max_retries=0)
        async with keyed as c:
            await _cached(c, content, stream=False)
            assert await _cached(c, content, stream=False) >= 4 * BLOCK
            async with aiohttp.ClientSession() as http:
                url = f"{stack.base_url}/v1/cache/reset"
                async with http.post(url) as denied:
                    assert denied.status == 401
                async with http.post(url, headers={"Authorization": "Bearer k"}) as reset:
                    assert reset.status == 200
                    body = await reset.json()
            answers = {a["role"]: a for a in body["workers"]}
            assert set(answers) == {"processor", "encode", "prefill+decode"}
            assert answers["prefill+decode"]["supported"] is True and answers["prefill+decode"]["blocks"] >= 4
            # The encode worker holds no KV pool, a processor no engine: neither has a cache to forget.
            assert answers["encode"]["supported"] is False and answers["processor"]["supported"] is False
            assert body["blocks"] == answers["prefill+decode"]["blocks"]
            assert await _cached(c, content, stream=False) == 0
    finally:
        await stop()


@pytest.mark.e2e
async def test_a_workers_health_port_resets_its_own_cache(stack: Stack) -> None:
    from pipeline.health import WorkerHealth

    [worker] = [w for w in stack.workers if w.role != "processor"]
    health = WorkerHealth()
    health.worker = worker
    port = await health.serve(0)
    content = "Tell me about the sea and the mountains and the long way between them. " * 6
    try:
        async with client(stack) as c:
            await _cached(c, content, stream=False)
            assert await _cached(c, content, stream=False) > 0
            async with aiohttp.ClientSession() as http:
                async with http.post(f"http://127.0.0.1:{port}/cache/reset") as reset:
                    assert reset.status == 200
                    body = await reset.json()
            assert body["role"] == worker.role and body["blocks"] >= 4
            assert await _cached(c, content, stream=False) == 0
    finally:
        await health.close()


@pytest.mark.e2e
async def test_a_one_token_answer_leaves_its_prompt_cached(stack: Stack) -> None:
    """``max_tokens`` 1 (a classifier's request): its sequence ends at its
    prefill, never stepping; the next same prompt still finds it cached,
    and answers the same."""
    content = "Is the sea larger than the mountains? Answer yes or no, and think about it for a long while. " * 4
    answers = []
    async with client(stack) as c:
        for turn in range(2):
            r = await c.completions.create(model="tiny-qwen2-vl", prompt=content, max_tokens=1, temperature=0)
            assert r.usage is not None and r.usage.prompt_tokens_details is not None
            cached = int(r.usage.prompt_tokens_details.cached_tokens or 0)
            assert (cached == 0) if turn == 0 else (cached >= 4 * BLOCK)
            assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 1
            answers.append(r.choices[0].text)
    assert answers[0] == answers[1]
