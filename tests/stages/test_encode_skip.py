"""A role that encodes and prefills does not encode media whose tokens the
prefix its prompt finds cached already holds (as vLLM skips the encoder for
them), and still gives generate()'s tokens; where those blocks go before
the prefill, the media are encoded after all."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from schemas.processed import ProcessedRequest
from schemas.request import ChatMessage, GenerateRequest, ImagePart, ImageURL, SamplingParams, TextPart
from stages.contract import HopContext
from stages.hop import HopStage
from stages.models import resolve_model
from stages.models.traits import load_traits
from stages.processor import Processor
from stages.torch_engine.engine import TorchEngine
from stages.torch_engine.hop_engine import TorchHopEngine
from stages.torch_engine.reference import reference_generate
from stages.torch_engine.settings import DecodeSettings
from tests.e2e.conftest import gradient, png_data_url

N = 6
ROLE = "encode+prefill+decode"
HISTORY = "We talked about the sea and the mountains for a long while. " * 4
# Two blocks' worth at least after the image: the block it ends in is full, so cached.
QUESTION = "What is in the picture? Tell me all about it, with care and in order. " * 2


@pytest.fixture
async def hop(tiny_model_dir: Path) -> AsyncIterator[TorchHopEngine]:
    engine = TorchHopEngine(ROLE, TorchEngine(tiny_model_dir, decode=DecodeSettings(slots=4, max_len=512)))
    await engine.start()
    yield engine
    await engine.close()


def _request(processor: Processor, rid: str, image: int, more: str = "") -> ProcessedRequest:
    url = png_data_url(gradient(64, 48, image))
    content = [TextPart(HISTORY), ImagePart(ImageURL(url)), TextPart(QUESTION + more)]
    sampling = SamplingParams(N, 0.0, min_tokens=N)
    return processor.process(GenerateRequest(rid, "tiny", [ChatMessage("user", content)], sampling))


async def _answer(hop: TorchHopEngine, req: ProcessedRequest) -> tuple[list[int], dict[str, float]]:
    ctx = HopContext()
    tokens: list[int] = []
    async with contextlib.aclosing(HopStage(ROLE, hop, "tiny").run(req, ctx)) as chunks:
        async for chunk in chunks:
            tokens += getattr(chunk, "token_ids", [])
    return tokens, ctx.trace


def _skipped() -> float:
    return REGISTRY.get_sample_value("mmpipe_encoder_skipped_items_total") or 0.0


async def test_an_image_whose_tokens_are_cached_is_not_encoded_again(hop: TorchHopEngine, tiny_model_dir: Path) -> None:
    processor = Processor(load_traits(resolve_model(str(tiny_model_dir), "tiny")))
    first = _request(processor, "a", 1)
    later = _request(processor, "b", 1, "And what colour is it?")
    skipped = _skipped()

    tokens, trace = await _answer(hop, first)
    assert tokens == reference_generate(tiny_model_dir, first.prompt_token_ids, [gradient(64, 48, 1)], N)
    assert "encode_s" in trace and "encode_skipped" not in trace

    tokens, trace = await _answer(hop, later)
    assert tokens == reference_generate(tiny_model_dir, later.prompt_token_ids, [gradient(64, 48, 1)], N)
    # Neither decoded nor through the tower: the prefix held every one of its tokens.
    assert trace["encode_skipped"] == 1.0 and "encode_s" not in trace and "media_decode_s" not in trace
    assert _skipped() - skipped == 1.0

    # Another image of the same size: the same placeholder tokens, other bytes, so encoded.
    other = _request(processor, "c", 2, "And what colour is it?")
    tokens, trace = await _answer(hop, other)
    assert tokens == reference_generate(tiny_model_dir, other.prompt_token_ids, [gradient(64, 48, 2)], N)
    assert "encode_s" in trace and "encode_skipped" not in trace


async def test_media_whose_cached_blocks_went_before_the_prefill_are_encoded_after_all(
    hop: TorchHopEngine, tiny_model_dir: Path
) -> None:
    processor = Processor(load_traits(resolve_model(str(tiny_model_dir), "tiny")))
    await _answer(hop, _request(processor, "a", 1))
    later = _request(processor, "b", 1, "And what colour is it?")
    ctx = HopContext()
    media = await hop.encode(later, ctx)
    assert [m.encoded for m in media] == [False]
    assert await hop.reset_prefix_cache()  # the blocks go between the encoder's look and the prefill
    handle = await hop.prefill(later, media, ctx)
    try:
        assert ctx.trace["encode_skipped"] == 0.0 and "encode_s" in ctx.trace and handle.cached_tokens == 0
        async with contextlib.aclosing(hop.decode(handle, later, ctx, hop.eos_token_ids.__contains__)) as out:
            tokens = [t async for t in out]
    finally:
        await hop.abort(handle)
    assert tokens == reference_generate(tiny_model_dir, later.prompt_token_ids, [gradient(64, 48, 1)], N)
