"""Chunked prefill (--max-num-batched-tokens): a prompt longer than the
budget is prefilled in chunks, one engine call each; its stream is still
generate()'s greedy tokens, and a running sequence's decode steps go in
between the chunks instead of waiting for the whole prompt."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from schemas.chunk import TokenChunk
from schemas.processed import ProcessedRequest
from stages.contract import HopContext
from stages.hop import HopStage
from stages.models import resolve_model
from stages.models.traits import load_traits
from stages.processor import Processor
from stages.torch_engine.engine import TorchEngine
from stages.torch_engine.hop_engine import TorchHopEngine
from stages.torch_engine.reference import reference_generate
from stages.torch_engine.settings import DecodeSettings
from tests.e2e.conftest import gradient
from tests.polling import eventually
from tests.stages.test_hop_engine import N, image_request


async def _stream(stage: HopStage[Any], req: ProcessedRequest, ctx: HopContext) -> list[int]:
    tokens: list[int] = []
    async for out in stage.run(req, ctx):
        assert isinstance(out, TokenChunk)
        tokens += out.token_ids
    return tokens


def _engine(tiny_model_dir: Path, budget: int) -> tuple[TorchEngine, TorchHopEngine, HopStage[Any]]:
    torch_engine = TorchEngine(tiny_model_dir, decode=DecodeSettings(slots=4, max_num_batched_tokens=budget))
    engine = TorchHopEngine("encode+prefill+decode", torch_engine, max_batch=4)
    return torch_engine, engine, HopStage(engine.role, engine, "tiny")


async def test_a_prompt_prefilled_in_chunks_gives_generates_tokens(tiny_model_dir: Path) -> None:
    processor = Processor(load_traits(resolve_model(str(tiny_model_dir), "tiny")))
    req = processor.process(image_request("c0"))
    expected = reference_generate(tiny_model_dir, req.prompt_token_ids, [gradient(60, 44, 3)], N)
    torch_engine, engine, stage = _engine(tiny_model_dir, budget=8)
    media = torch_engine.encode([gradient(60, 44, 3)])
    prompt_len = len(torch_engine._prepare(req.prompt_token_ids, media, [])[0])
    assert torch_engine.chunked(prompt_len) and not torch_engine.chunked(8)
    await engine.start()
    try:
        ctx = HopContext()
        assert await _stream(stage, req, ctx) == expected
    finally:
        await engine.close()
    assert ctx.trace["prefill_chunks"] == -(-prompt_len // 8)


async def test_running_sequences_step_between_the_chunks_of_a_long_prompt(tiny_model_dir: Path) -> None:
    processor = Processor(load_traits(resolve_model(str(tiny_model_dir), "tiny")))
    running, long = processor.process(image_request("c1", max_tokens=60)), processor.process(image_request("c2"))
    torch_engine, engine, stage = _engine(tiny_model_dir, budget=4)
    calls: list[str] = []
    for name in ("launch", "step", "prefill_chunk"):
        real = getattr(torch_engine, name)

        def logged(*args: Any, real: Any = real, name: str = name, **kwargs: Any) -> Any:
            calls.append("chunk" if name == "prefill_chunk" else "step")
            return real(*args, **kwargs)

        setattr(torch_engine, name, logged)
    await engine.start()
    try:
        first = asyncio.ensure_future(_stream(stage, running, HopContext()))
        await eventually(lambda: calls.count("step") >= 3, within=10.0)  # the first request is decoding
        start = len(calls)
        second = await _stream(stage, long, HopContext())
        await first
    finally:
        await engine.close()
    chunks = [i for i, c in enumerate(calls) if c == "chunk" and i >= start]
    assert len(chunks) > 2, calls
    assert "step" in calls[chunks[0] : chunks[-1]], calls  # the running sequence stepped meanwhile
    assert len(second) == N
