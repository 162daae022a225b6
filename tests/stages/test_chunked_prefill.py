"""Chunked prefill (--max-num-batched-tokens): a prompt longer than the
budget is prefilled in chunks, one engine call each; its stream is still
generate()'s greedy tokens, and a running sequence's decode steps go in
between the chunks instead of waiting for the whole prompt."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

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


def _engine(
    tiny_model_dir: Path, budget: int, graphed: bool = False
) -> tuple[TorchEngine, TorchHopEngine, HopStage[Any]]:
    # graphed: the fused layers' prefill straight into the pool's blocks (a GPU's default), eager here.
    fused = {"fused": True, "graph_prefill_len": 32} if graphed else {}
    decode = DecodeSettings(slots=4, max_num_batched_tokens=budget, **fused)  # type: ignore[arg-type]
    torch_engine = TorchEngine(tiny_model_dir, decode=decode)
    engine = TorchHopEngine("encode+prefill+decode", torch_engine, max_batch=4)
    return torch_engine, engine, HopStage(engine.role, engine, "tiny")


@pytest.mark.parametrize(("budget", "graphed"), [(8, False), (16, True)])
async def test_a_prompt_prefilled_in_chunks_gives_generates_tokens(
    tiny_model_dir: Path, budget: int, graphed: bool
) -> None:
    processor = Processor(load_traits(resolve_model(str(tiny_model_dir), "tiny")))
    req = processor.process(image_request("c0"))
    expected = reference_generate(tiny_model_dir, req.prompt_token_ids, [gradient(60, 44, 3)], N)
    torch_engine, engine, stage = _engine(tiny_model_dir, budget=budget, graphed=graphed)
    media = torch_engine.encode([gradient(60, 44, 3)])
    prompt_len = len(torch_engine._prepare(req.prompt_token_ids, media, [])[0])
    assert torch_engine.chunked(prompt_len) and not torch_engine.chunked(budget)
    await engine.start()
    try:
        ctx = HopContext()
        assert await _stream(stage, req, ctx) == expected
    finally:
        await engine.close()
    assert ctx.trace["prefill_chunks"] == -(-prompt_len // budget)


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


async def test_a_request_cancelled_between_graphed_chunks_gives_its_blocks_back(tiny_model_dir: Path) -> None:
    """Chunks through the graphed prefill hold the prompt's blocks from the
    first chunk on: a request whose client goes between two chunks gives
    them (and its promised row) back, and the engine serves the next."""
    processor = Processor(load_traits(resolve_model(str(tiny_model_dir), "tiny")))
    torch_engine, engine, stage = _engine(tiny_model_dir, budget=16, graphed=True)
    decoder, slots = torch_engine.decoder, torch_engine._slots
    assert decoder is not None and slots is not None
    free = decoder.pool.num_free
    chunks = 0
    real, gate = torch_engine.prefill_chunk, threading.Event()

    def gated(*args: Any, **kwargs: Any) -> Any:
        nonlocal chunks
        chunks += 1
        if chunks == 1:
            gate.wait(10.0)  # the first chunk runs once the client has gone
        return real(*args, **kwargs)

    torch_engine.prefill_chunk = gated  # type: ignore[method-assign]
    await engine.start()
    try:
        req = processor.process(image_request("c3"))
        media = torch_engine.encode([gradient(60, 44, 3)])
        assert len(torch_engine._prepare(req.prompt_token_ids, media, [])[0]) > 16  # two chunks or more
        task = asyncio.ensure_future(_stream(stage, req, HopContext()))
        await eventually(lambda: chunks == 1, within=10.0)
        assert slots.promised == 1 and decoder.pool.num_free < free
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        gate.set()
        await eventually(lambda: slots.promised == 0 and decoder.pool.num_free == free, within=10.0)
        assert not slots.rows
        assert len(await _stream(stage, processor.process(image_request("c4")), HopContext())) == N
    finally:
        await engine.close()
