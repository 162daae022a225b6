"""The hop stage as a plain async function: no NATS."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from schemas.chunk import FinishReason, TokenChunk
from schemas.request import ChatMessage, GenerateRequest, ImagePart, ImageURL, SamplingParams, TextPart
from stages.contract import HopContext
from stages.hop import HopStage
from stages.media import EmbeddingCache, MediaPolicy
from stages.models import resolve_model
from stages.models.traits import load_traits
from stages.processor import Processor
from stages.torch_engine.engine import TorchEngine
from stages.torch_engine.hop_engine import TorchHopEngine
from stages.torch_engine.reference import reference_generate
from stages.torch_engine.scheduler import DecodeScheduler
from tests.e2e.conftest import gradient, png_data_url, serve_on_loopback


@pytest.fixture
async def stage(tiny_model_dir: Path) -> AsyncIterator[HopStage]:
    s = HopStage("encode+prefill+decode", TorchHopEngine("encode+prefill+decode", TorchEngine(tiny_model_dir)), "tiny")
    await s.start()
    yield s
    await s.close()


@pytest.fixture
async def image_server_url() -> AsyncIterator[str]:
    """The same image bytes as png_data_url(gradient(60, 44, 3)), over http on loopback."""
    body = base64.b64decode(png_data_url(gradient(60, 44, 3)).split(",", 1)[1])

    async def handle(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="image/png")

    app = web.Application()
    app.router.add_get("/img.png", handle)
    async with serve_on_loopback(app) as url:
        yield url


@pytest.fixture(scope="module")
def processor(tiny_model_dir: Path) -> Processor:
    return Processor(load_traits(resolve_model(str(tiny_model_dir), "tiny")))


def scheduler(stage: HopStage) -> DecodeScheduler:
    assert isinstance(stage.engine, TorchHopEngine) and stage.engine.scheduler is not None
    return stage.engine.scheduler


def image_request(n: int, url: str | None = None, **sampling: Any) -> GenerateRequest:
    content = [ImagePart(ImageURL(url or png_data_url(gradient(60, 44, 3)))), TextPart("What is it?")]
    return GenerateRequest(
        "r1", "tiny", [ChatMessage("user", content)], SamplingParams(max_tokens=n, min_tokens=n, **sampling)
    )


async def run(
    stage: HopStage, processed: Any, emitted: list[int] | None = None, ctx: HopContext | None = None
) -> list[TokenChunk]:
    ctx = ctx or HopContext(emitted=emitted or [])
    return [c async for c in stage.run(processed, ctx)]  # type: ignore[misc]


async def test_tokens_equal_generate_and_chunks_are_well_formed(
    stage: HopStage, processor: Processor, tiny_model_dir: Path
) -> None:
    processed = processor.process(image_request(10, temperature=0.0))
    chunks = await run(stage, processed)
    expected = reference_generate(tiny_model_dir, processed.prompt_token_ids, [gradient(60, 44, 3)], 10)
    assert [t for c in chunks for t in c.token_ids] == expected
    assert [c.seq for c in chunks] == list(range(10))
    assert [c.finish_reason for c in chunks] == [None] * 9 + [FinishReason.LENGTH]
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 10
    assert usage.prompt_tokens > len(processed.prompt_token_ids)  # the placeholder became the image's tokens
    assert "".join(c.text for c in chunks) == stage.engine.tokenizer.decode(expected, skip_special_tokens=True)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
async def test_a_takeover_continues_exactly_where_the_stream_stopped(
    stage: HopStage, processor: Processor, temperature: float
) -> None:
    processed = processor.process(image_request(9, temperature=temperature, seed=5))
    full = await run(stage, processed)
    tokens = [t for c in full for t in c.token_ids]
    resumed = await run(stage, processed, emitted=tokens[:4])
    assert [c.seq for c in resumed] == list(range(4, 9))
    assert [t for c in resumed for t in c.token_ids] == tokens[4:]
    assert "".join(c.text for c in full[:4]) + "".join(c.text for c in resumed) == "".join(c.text for c in full)
    done = await run(stage, processed, emitted=tokens)
    assert [(c.seq, c.token_ids, c.finish_reason) for c in done] == [(9, [], FinishReason.LENGTH)]


async def test_leaving_mid_stream_frees_the_sequence(stage: HopStage, processor: Processor) -> None:
    processed = processor.process(
        GenerateRequest("r2", "tiny", [ChatMessage("user", "go on")], SamplingParams(max_tokens=500, ignore_eos=True))
    )
    gen = stage.run(processed, HopContext())
    await anext(gen)
    await anext(gen)
    assert scheduler(stage).active == 1
    await gen.aclose()
    for _ in range(50):
        if scheduler(stage).active == 0:
            break
        await asyncio.sleep(0.02)
    assert scheduler(stage).active == 0


async def test_concurrent_requests_share_the_decode_loop(
    stage: HopStage, processor: Processor, tiny_model_dir: Path
) -> None:
    requests = [
        processor.process(
            GenerateRequest(
                f"c{i}",
                "tiny",
                [ChatMessage("user", f"Count to {i}.")],
                SamplingParams(max_tokens=6, min_tokens=6, temperature=0),
            )
        )
        for i in range(4)
    ]
    results = await asyncio.gather(*(run(stage, p) for p in requests))
    for p, chunks in zip(requests, results, strict=True):
        expected = reference_generate(tiny_model_dir, p.prompt_token_ids, [], 6)
        assert [t for c in chunks for t in c.token_ids] == expected


async def test_embedding_cache_hit_skips_the_encoder_and_keeps_the_tokens(
    processor: Processor, tiny_model_dir: Path, image_server_url: str
) -> None:
    cache = EmbeddingCache(1 << 20, name="test-hop-cache")
    role = "encode+prefill+decode"
    engine = TorchHopEngine(
        role, TorchEngine(tiny_model_dir), media_policy=MediaPolicy(allow_internal=True), embedding_cache=cache
    )
    stage = HopStage(role, engine, "tiny")
    await stage.start()
    try:
        image = gradient(60, 44, 3)
        by_data = processor.process(image_request(6, temperature=0.0))
        expected = reference_generate(tiny_model_dir, by_data.prompt_token_ids, [image], 6)
        ctx = HopContext()
        assert [t for c in await run(stage, by_data, ctx=ctx) for t in c.token_ids] == expected
        assert ctx.trace["cache_hit"] == 0.0 and "encode_s" in ctx.trace
        # The same bytes by another URL: the key is the content, not the URL.
        by_url = processor.process(image_request(6, temperature=0.0, url=f"{image_server_url}/img.png"))
        ctx = HopContext()
        assert [t for c in await run(stage, by_url, ctx=ctx) for t in c.token_ids] == expected
        assert ctx.trace["cache_hit"] == 1.0 and "encode_s" not in ctx.trace
        assert cache.stats()["hits"] == 1 and cache.stats()["entries"] == 1
        # Two images are one entry of their own; each alone was a different set.
        two = processor.process(
            GenerateRequest(
                "r3",
                "tiny",
                [
                    ChatMessage(
                        "user", [ImagePart(ImageURL(png_data_url(image))), ImagePart(ImageURL(png_data_url(image)))]
                    )
                ],
                SamplingParams(max_tokens=4, min_tokens=4, temperature=0.0),
            )
        )
        await run(stage, two)
        assert cache.stats()["entries"] == 2 and cache.stats()["hits"] == 1
    finally:
        await stage.close()


async def test_sequences_ending_at_different_steps_and_a_sampled_one_keep_their_tokens(
    stage: HopStage, processor: Processor, tiny_model_dir: Path
) -> None:
    """The decode loop launches each step before reading the last one's
    tokens: a sequence that ends has taken one step more (its slot refilled
    by the last one while that step runs), and a batch holding a sequence
    that samples on the host steps one at a time until it leaves."""

    def request(i: int, n: int, **sampling: Any) -> Any:
        params = SamplingParams(max_tokens=n, min_tokens=n, **sampling)
        return processor.process(GenerateRequest(f"m{i}", "tiny", [ChatMessage("user", f"Count to {i}.")], params))

    def tokens(chunks: list[TokenChunk]) -> list[int]:
        return [t for c in chunks for t in c.token_ids]

    def expected(p: Any) -> list[int]:
        return reference_generate(tiny_model_dir, p.prompt_token_ids, [], p.max_tokens)

    # Greedy only: every step after the first is launched ahead. The first to
    # end leaves a hole that the last row (12 tokens, a step in flight) fills.
    greedy = [request(i, n, temperature=0) for i, n in enumerate((3, 9, 5, 12))]
    results = await asyncio.gather(*(run(stage, p) for p in greedy))
    assert [tokens(r) for r in results] == [expected(p) for p in greedy]
    # With a sampled one: one step at a time while it runs, ahead again after it.
    sampled = request(9, 4, temperature=0.9, seed=3)
    alone = tokens(await run(stage, sampled))
    mixed = [greedy[1], sampled, greedy[3]]
    results = await asyncio.gather(*(run(stage, p) for p in mixed))
    assert [tokens(r) for r in results] == [expected(greedy[1]), alone, expected(greedy[3])]
    assert scheduler(stage).active == 0
    engine = stage.engine
    assert isinstance(engine, TorchHopEngine) and engine.torch._slots is not None
    assert engine.torch._slots.taken == 0
