"""Prefill of several prompts in one forward (``--prefill-batch``): each
sequence leaves with its own cache and next token, the same tokens as its
prefill alone (the cache equal up to the last bits), and the hop stage
gathers new prompts that wait together into one call."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from schemas.request import ChatMessage, GenerateRequest, SamplingParams
from stages.contract import HopContext
from stages.hop import HopStage
from stages.models import builtin_path, resolve_model
from stages.models.traits import load_traits
from stages.processor import Processor
from stages.torch_engine.engine import TorchEngine
from stages.torch_engine.hop_engine import TorchHopEngine
from stages.torch_engine.reference import reference_generate
from stages.torch_engine.settings import DecodeSettings
from tests.stages.engine_helpers import chat_prompt, decode, greedy


def _image(seed: int, width: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (56, width, 3), dtype=np.uint8))


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-llava"])
def test_prompts_together_give_each_its_tokens_alone(name: str, mmpipe_home: Path) -> None:
    engine = TorchEngine(builtin_path(name), decode=DecodeSettings(batched=False))
    jobs = []
    for i in range(3):  # different lengths; the middle one text only
        media = engine.encode([_image(i, 56 + 28 * i)]) if i != 1 else []
        content = [{"type": "image"}] * len(media) + [{"type": "text", "text": "Say more. " * (i + 1)}]
        jobs.append((chat_prompt(engine, content), media, greedy(6)))
    together = engine.prefill_together(jobs)
    for (seq, first), (prompt, media, sampling) in zip(together, jobs, strict=True):
        alone, alone_first = engine.prefill([prompt], [media], [sampling])[0]
        assert (seq.prompt_len, seq.rope_delta) == (alone.prompt_len, alone.rope_delta)
        for mine, theirs in zip(seq.cache.layers, alone.cache.layers, strict=True):
            assert mine.keys.shape == theirs.keys.shape  # no padding left in a sequence's cache
            torch.testing.assert_close(mine.keys, theirs.keys, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(mine.values, theirs.values, rtol=1e-4, atol=1e-5)
        assert decode(engine, seq, first, 6) == decode(engine, alone, alone_first, 6)


def test_one_prompt_alone_is_prefill_exactly(tiny_model_dir: Path) -> None:
    engine = TorchEngine(tiny_model_dir, decode=DecodeSettings(batched=False))
    job = (chat_prompt(engine, [{"type": "text", "text": "Hello."}]), [], greedy(4))
    (seq, first), (alone, alone_first) = engine.prefill_together([job])[0], engine.prefill(*map(list, zip(job)))[0]
    assert first == alone_first
    for mine, theirs in zip(seq.cache.layers, alone.cache.layers, strict=True):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


async def test_the_hop_stage_prefills_waiting_prompts_in_one_call(tiny_model_dir: Path) -> None:
    engine = TorchHopEngine("encode+prefill+decode", TorchEngine(tiny_model_dir), prefill_batch=4)
    stage = HopStage("encode+prefill+decode", engine, "tiny")
    processor = Processor(load_traits(resolve_model(str(tiny_model_dir), "tiny")))
    await stage.start()
    try:
        requests = [
            processor.process(
                GenerateRequest(
                    f"p{i}",
                    "tiny",
                    [ChatMessage("user", "Count to " + "ten, " * i)],
                    SamplingParams(max_tokens=6, min_tokens=6, temperature=0),
                )
            )
            for i in range(4)
        ]

        async def run(p: object) -> list[int]:
            return [t async for c in stage.run(p, HopContext()) for t in c.token_ids]  # type: ignore[arg-type,attr-defined]

        results = await asyncio.gather(*(run(p) for p in requests))
        assert engine.prefills.calls < len(requests)  # some shared a forward
        for p, tokens in zip(requests, results, strict=True):
            assert tokens == reference_generate(tiny_model_dir, p.prompt_token_ids, [], 6)
    finally:
        await stage.close()


@pytest.mark.parametrize("budget", [0, 32])
async def test_a_prompt_that_finds_its_prefix_cached_prefills_alone_past_it(tiny_model_dir: Path, budget: int) -> None:
    """With --prefill-batch (and --max-num-batched-tokens: a prompt longer
    than it goes in chunks), only a lone prefill looks the prefix up: a later
    turn whose conversation is cached goes alone, prefills only its rest
    (not in chunks where the rest is short), and still gives generate()'s
    tokens."""
    decode = DecodeSettings(slots=4, max_num_batched_tokens=budget)
    engine = TorchHopEngine("encode+prefill+decode", TorchEngine(tiny_model_dir, decode=decode), prefill_batch=4)
    stage = HopStage("encode+prefill+decode", engine, "tiny")
    processor = Processor(load_traits(resolve_model(str(tiny_model_dir), "tiny")))
    history = [ChatMessage("user", "Tell me about the sea " * 10), ChatMessage("assistant", "It is wide and deep.")]

    def turn(rid: str, messages: list[ChatMessage]) -> object:
        return processor.process(GenerateRequest(rid, "tiny", messages, SamplingParams(6, 0.0, min_tokens=6)))

    first, later = turn("t1", history), turn("t2", [*history, ChatMessage("user", "And the sky?")])
    await stage.start()
    try:
        runs = []
        for req in (first, later):
            ctx = HopContext()
            chunks = [c async for c in stage.run(req, ctx)]  # type: ignore[arg-type]
            runs.append((req, ctx, chunks))
    finally:
        await stage.close()
    for req, _, chunks in runs:
        tokens = [t for c in chunks for t in c.token_ids]
        assert tokens == reference_generate(tiny_model_dir, req.prompt_token_ids, [], 6)  # type: ignore[attr-defined]
    (_, first_ctx, first_chunks), (later_req, later_ctx, later_chunks) = runs
    assert first_chunks[-1].usage.cached_tokens == 0
    cached = later_chunks[-1].usage.cached_tokens
    pairs = zip(first.prompt_token_ids, later_req.prompt_token_ids, strict=False)  # type: ignore[attr-defined]
    shared = next(i for i, (a, b) in enumerate(pairs) if a != b)
    assert cached == shared // 16 * 16 > 48  # every full block of the turns they share
    if budget:
        assert first_ctx.trace["prefill_chunks"] > 1  # the first turn in chunks
        assert len(later_req.prompt_token_ids) - cached <= budget and "prefill_chunks" not in later_ctx.trace  # type: ignore[attr-defined]


def test_groups_keep_padded_forwards_within_the_budget() -> None:
    from stages.torch_engine.prefill_together import padded_groups

    assert padded_groups([5, 3, 9], budget=100) == [[1, 0, 2]]  # shortest first, all in one
    groups = padded_groups([10, 40, 20, 30, 200], budget=80)
    assert sorted(i for g in groups for i in g) == [0, 1, 2, 3, 4]  # each prompt exactly once
    lengths = [10, 40, 20, 30, 200]
    for g in groups:
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 80
    assert [4] in groups  # longer than the budget: alone
