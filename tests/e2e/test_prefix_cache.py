"""Prefix caching through the official openai client, in every mode: a
second turn that starts as the first reuses the KV blocks of the worker
that prefilled it, reports them as ``usage.prompt_tokens_details
.cached_tokens``, and still answers exactly as generate() does. Which
worker caches: the one that prefills, where it holds a KV pool (on a CPU
a prefill-only worker hands its cache on and keeps no pool)."""

from __future__ import annotations

from typing import Any

import pytest

from schemas.routes import MODES
from tests.e2e.conftest import ask, client, gradient, png_data_url
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
