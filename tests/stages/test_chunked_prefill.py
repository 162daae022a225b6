"""Chunked prefill (--max-num-batched-tokens): a prompt longer than the
budget is prefilled in chunks; its stream is still generate()'s greedy
tokens, and a running sequence's decode steps carry the chunks (in the
step's forward where the fused layers prefill into blocks: a mixed step)
instead of waiting for the whole prompt."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from prometheus_client import REGISTRY

from schemas.chunk import TokenChunk
from schemas.processed import ProcessedRequest
from schemas.request import ChatMessage, GenerateRequest, SamplingParams, TextPart
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
from tests.stages.engine_helpers import greedy
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


def _chunks_run() -> dict[str, float]:
    return {
        how: REGISTRY.get_sample_value("mmpipe_prefill_chunks_total", {"how": how}) or 0.0
        for how in ("mixed", "after_step", "alone")
    }


async def test_running_sequences_step_between_the_chunks_of_a_long_prompt(tiny_model_dir: Path) -> None:
    processor = Processor(load_traits(resolve_model(str(tiny_model_dir), "tiny")))
    running, long = processor.process(image_request("c1", max_tokens=60)), processor.process(image_request("c2"))
    torch_engine, engine, stage = _engine(tiny_model_dir, budget=4)
    calls: list[str] = []
    for name in ("launch", "step", "_prefill_chunk"):
        real = getattr(torch_engine, name)

        def logged(*args: Any, real: Any = real, name: str = name, **kwargs: Any) -> Any:
            calls.append("chunk" if name == "_prefill_chunk" else "step")
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
    # The modules' chunks (the CPU's default) each go with a step, run just after it.
    assert all(calls[i - 1] == "step" for i in chunks), calls
    assert len(second) == N


def test_a_decode_step_carries_a_chunk_in_its_forward_and_both_keep_generates_tokens(
    tiny_model_dir: Path, engine_device: str
) -> None:
    """vLLM v1's mixed batch: each chunk of a long prompt runs in a running
    sequence's decode step, one forward over the step's row and the chunk's
    rows (each layer's weights read once for both); the running stream and
    the prompt's are both generate()'s. Without graphs: with them the
    chunk replays its own after the step (a GPU's default)."""
    engine = _fused(tiny_model_dir, engine_device, budget=32, cuda_graphs=False)
    short = list(engine.tokenizer("Count with me:")["input_ids"])
    [(running, _)] = engine.prefill([short], [[]], [greedy(40)])
    prompt = list(engine.tokenizer(" ".join(f"word{i}" for i in range(60)))["input_ids"])
    prefilling = engine.start_prefill(prompt, [], greedy(N))
    before = _chunks_run()
    chunks, out = 0, None
    while out is None:
        launch = engine.launch([running], chunk=prefilling)
        assert launch is not None and launch.carried and launch.stepped == [True]
        engine.collect(launch)
        out = launch.chunk
        chunks += 1
    assert not isinstance(out, BaseException)
    seq, first = out
    after = _chunks_run()
    assert chunks == -(-len(prompt) // 32) and len(running.output_ids) == 1 + chunks
    assert after["mixed"] - before["mixed"] == chunks
    assert after["alone"] == before["alone"] and after["after_step"] == before["after_step"]
    # On a GPU the chunk's token stays on the device until settled (-1 here).
    settled = engine.settle(seq)
    assert seq.output_ids == [settled] and seq.slot >= 0
    assert first == (settled if engine_device == "cpu" else -1)
    assert _decoded(engine, running, 40) == reference_generate(tiny_model_dir, short, [], 40)
    assert _decoded(engine, seq, N) == reference_generate(tiny_model_dir, prompt, [], N)
    pool = engine.decoder.pool
    assert pool.num_free == pool.capacity


def test_a_mixed_step_of_an_adapters_chunk_beside_a_row_without_one(
    tiny_model_dir: Path, engine_device: str, tmp_path: Path
) -> None:
    """The chunk's rows take its adapter's update in the step's projections
    (and the head its adapter's), the step's row none: PEFT's tokens for the
    prompt, generate()'s for the running sequence."""
    pytest.importorskip("peft")
    from tests.stages.test_lora import _reference, make_adapter

    peft_model = make_adapter(tiny_model_dir, tmp_path / "adapter", seed=7)
    engine = _fused(tiny_model_dir, engine_device, budget=32, cuda_graphs=False)
    engine.load_lora("adapter", tmp_path / "adapter")
    short = list(engine.tokenizer("Count with me:")["input_ids"])
    [(running, _)] = engine.prefill([short], [[]], [greedy(N)])
    prompt = list(engine.tokenizer(" ".join(f"word{i}" for i in range(60)))["input_ids"])
    prefilling = engine.start_prefill(prompt, [], greedy(N), lora="adapter")
    out = None
    while out is None:
        launch = engine.launch([running], chunk=prefilling)
        assert launch is not None and launch.carried
        engine.collect(launch)
        out = launch.chunk
    assert not isinstance(out, BaseException)
    seq = out[0]
    engine.settle(seq)
    assert _decoded(engine, running, N) == reference_generate(tiny_model_dir, short, [], N)
    assert _decoded(engine, seq, N) == _reference(tiny_model_dir, peft_model, prompt, [], N)


@pytest.mark.parametrize("chosen_by", ["device", "host"])
async def test_a_long_prompt_beside_running_streams_goes_in_mixed_steps_through_the_hop(
    tiny_model_dir: Path, engine_device: str, chosen_by: str
) -> None:
    """Through the decode loop: while a stream decodes, a long prompt's
    chunks all ride its steps (none alone: in the step's forward, or with
    graphs each its own graph right after the step), and both streams are
    generate()'s. Its tokens chosen on the device (steps launched ahead), or
    by the host (a stop id masked below min_tokens: its batch is stepped,
    not launched; the id one generate() never chooses, so it changes no
    greedy choice)."""
    torch_engine = _fused(tiny_model_dir, engine_device, budget=16)
    engine = TorchHopEngine("encode+prefill+decode", torch_engine, max_batch=4)
    stage: HopStage[Any] = HopStage(engine.role, engine, "tiny")
    processor = Processor(load_traits(resolve_model(str(tiny_model_dir), "tiny")))

    def text(rid: str, words: str, n: int, stop: list[int] | None = None) -> ProcessedRequest:
        sampling = SamplingParams(n, 0.0, min_tokens=n, stop_token_ids=stop or [])
        return processor.process(GenerateRequest(rid, "tiny", [ChatMessage("user", [TextPart(words)])], sampling))

    want = reference_generate(tiny_model_dir, text("m0", "Count with me", 200).prompt_token_ids, [], 200)
    unused = next(t for t in range(100, 1000) if t not in want)
    running = text("m0", "Count with me", 200, [unused] if chosen_by == "host" else None)
    long = text("m1", " ".join(f"word{i}" for i in range(40)), N)
    steps = 0
    name = "launch" if chosen_by == "device" else "step_carrying"
    real = getattr(torch_engine, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal steps
        steps += 1
        return real(*args, **kwargs)

    setattr(torch_engine, name, counted)
    await engine.start()
    try:
        first = asyncio.ensure_future(_stream(stage, running, HopContext()))
        await eventually(lambda: steps >= 3, within=10.0)  # the first request is decoding (launched, or stepped)
        before = _chunks_run()
        ctx = HopContext()
        second = await _stream(stage, long, ctx)
        after = _chunks_run()
        assert not first.done()  # still decoding: every chunk had a step to ride
        tokens = await first
    finally:
        await engine.close()
    assert torch_engine._slot_prefill is not None
    how, other = ("after_step", "mixed") if torch_engine._slot_prefill.use_graphs else ("mixed", "after_step")
    assert after[how] - before[how] == ctx.trace["prefill_chunks"] > 2
    assert after["alone"] == before["alone"] and after[other] == before[other]
    assert second == reference_generate(tiny_model_dir, long.prompt_token_ids, [], N)
    assert tokens == want


def _fused(tiny_model_dir: Path, device: str, budget: int, slots: int = 4, **settings: Any) -> TorchEngine:
    """The fused layers prefilling into the pool (a GPU's default), in float32
    on the test device (``--engine-device``)."""
    decode = DecodeSettings(slots=slots, max_len=512, fused=True, max_num_batched_tokens=budget, **settings)
    engine = TorchEngine(tiny_model_dir, device=device, dtype=torch.float32, decode=decode)
    assert engine._slot_prefill is not None and engine.decoder is not None
    return engine


def _chunked(engine: TorchEngine, prompt: list[int], n: int) -> tuple[Any, Any, int]:
    """The prompt prefilled chunk by chunk: (its Prefilling, its sequence, the chunks)."""
    prefilling = engine.start_prefill(prompt, [], greedy(n))
    chunks, out = 0, None
    while out is None:
        out = engine.prefill_chunk(prefilling)
        chunks += 1
    seq, first = out
    assert first == seq.output_ids[0]
    return prefilling, seq, chunks


def _decoded(engine: TorchEngine, seq: Any, n: int) -> list[int]:
    tokens = list(seq.output_ids)
    while len(tokens) < n:
        tokens += engine.step([seq])
    engine.release(seq)
    return tokens


def test_chunks_prefill_straight_into_blocks_and_give_generates_tokens(
    tiny_model_dir: Path, engine_device: str
) -> None:
    """On the fused layers a long prompt's chunks write their keys and values
    into the blocks the prompt took at its first chunk (no cache of the
    model's own, nothing copied into the pool after), each chunk attending
    over the ones before it there: the stream is generate()'s."""
    engine = _fused(tiny_model_dir, engine_device, budget=40)  # chunks of 32: whole blocks
    prompt = list(engine.tokenizer(" ".join(f"word{i}" for i in range(60)))["input_ids"])
    assert len(prompt) > 96
    prefilling, seq, chunks = _chunked(engine, prompt, N)
    assert prefilling.into_blocks and prefilling.blocks is None  # the sequence holds them now
    assert chunks == -(-len(prompt) // 32)
    assert seq.cache is None and seq.slot >= 0 and len(seq.blocks) == engine.decoder.blocks_for(len(prompt))
    assert _decoded(engine, seq, N) == reference_generate(tiny_model_dir, prompt, [], N)
    pool = engine.decoder.pool
    assert pool.num_free == pool.capacity


def test_a_later_turn_chunks_only_past_its_cached_prefix(tiny_model_dir: Path, engine_device: str) -> None:
    engine = _fused(tiny_model_dir, engine_device, budget=32)
    first = list(engine.tokenizer(" ".join(f"word{i}" for i in range(60)))["input_ids"])
    _, seq, _ = _chunked(engine, first, 2)
    _decoded(engine, seq, 2)
    later = first + list(engine.tokenizer(" and then some more words to say", add_special_tokens=False)["input_ids"])
    prefilling, seq, chunks = _chunked(engine, later, N)
    cached = len(first) // 16 * 16
    assert seq.cached_tokens == prefilling.cached == cached
    assert chunks == -(-(len(later) - cached) // 32)
    assert _decoded(engine, seq, N) == reference_generate(tiny_model_dir, later, [], N)


def test_a_chunked_prefill_given_up_gives_its_blocks_back(tiny_model_dir: Path, engine_device: str) -> None:
    engine = _fused(tiny_model_dir, engine_device, budget=32)
    pool = engine.decoder.pool
    prompt = list(engine.tokenizer(" ".join(f"word{i}" for i in range(60)))["input_ids"])
    prefilling = engine.start_prefill(prompt, [], greedy(N))
    assert engine.prefill_chunk(prefilling) is None
    assert pool.num_free == pool.capacity - engine.decoder.blocks_for(len(prompt))
    engine.drop_prefill(prefilling)
    assert pool.num_free == pool.capacity
    engine.drop_prefill(prefilling)  # again: nothing held
    assert pool.num_free == pool.capacity


def test_a_chunked_prompt_that_finds_no_row_joins_the_batch_as_one_leaves(
    tiny_model_dir: Path, engine_device: str
) -> None:
    """Its last chunk done while every decoder row is taken, the sequence
    waits with its cache in its blocks; it takes a row once one is free and
    decodes generate()'s tokens from there."""
    engine = _fused(tiny_model_dir, engine_device, budget=32, slots=1)
    short = list(engine.tokenizer("Hi there")["input_ids"])
    [(running, _)] = engine.prefill([short], [[]], [greedy(N)])
    assert running.slot == 0
    prompt = list(engine.tokenizer(" ".join(f"word{i}" for i in range(60)))["input_ids"])
    _, seq, _ = _chunked(engine, prompt, N)
    assert seq.slot < 0 and seq.cache is None and seq.blocks
    assert engine.step([running, seq])[1] is None  # no row for it yet
    engine.release(running)
    assert _decoded(engine, seq, N) == reference_generate(tiny_model_dir, prompt, [], N)


async def test_a_long_prompt_cancelled_between_its_chunks_leaves_no_block_held(
    tiny_model_dir: Path, engine_device: str
) -> None:
    """A client gone while its prompt is part way through its chunks: the
    blocks the prompt took at its first chunk go back to the pool, after
    the chunk the engine's thread was running."""
    torch_engine = _fused(tiny_model_dir, engine_device, budget=16)
    engine = TorchHopEngine("encode+prefill+decode", torch_engine, max_batch=4)
    stage: HopStage[Any] = HopStage(engine.role, engine, "tiny")
    processor = Processor(load_traits(resolve_model(str(tiny_model_dir), "tiny")))
    words = TextPart(" ".join(f"word{i}" for i in range(40)))
    req = processor.process(GenerateRequest("c3", "tiny", [ChatMessage("user", [words])], SamplingParams(N, 0.0)))
    assert len(req.prompt_token_ids) > 3 * 16
    gate, calls = threading.Event(), 0
    real = torch_engine.prefill_chunk

    def gated(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:
            gate.wait(30)  # the second chunk waits on the engine's thread while the client goes
        return real(*args, **kwargs)

    torch_engine.prefill_chunk = gated  # type: ignore[method-assign]
    pool = torch_engine.decoder.pool
    await engine.start()
    try:
        task = asyncio.ensure_future(_stream(stage, req, HopContext()))
        await eventually(lambda: calls >= 2, within=10.0)
        assert pool.num_free < pool.capacity
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()
        await eventually(lambda: pool.num_free == pool.capacity, within=10.0)
    finally:
        gate.set()
        await engine.close()
    assert calls == 2  # no chunk after the client went


def test_a_prompt_chunked_into_a_prefill_roles_blocks_hands_off_its_cache(
    tiny_model_dir: Path, engine_device: str
) -> None:
    """A role that ends at prefill (E/P/D's prefill) chunks a long prompt
    into its pool's blocks; the cache it exports from them decodes to
    generate()'s tokens in another engine."""
    prefill = _fused(tiny_model_dir, engine_device, budget=32, decodes=False)
    prompt = list(prefill.tokenizer(" ".join(f"word{i}" for i in range(60)))["input_ids"])
    prefilling, seq, chunks = _chunked(prefill, prompt, N)
    assert prefilling.into_blocks and chunks > 2
    tensors, state = prefill.export_kv(seq)
    prefill.release(seq)
    decoder = TorchEngine(tiny_model_dir, device=engine_device, dtype=torch.float32, decode=DecodeSettings(slots=4))
    moved = decoder.import_kv(tensors, state, greedy(N))
    assert _decoded(decoder, moved, N) == reference_generate(tiny_model_dir, prompt, [], N)


async def test_a_long_prompt_of_an_adapter_goes_in_chunks_with_it(
    tiny_model_dir: Path, engine_device: str, tmp_path: Path
) -> None:
    """A LoRA adapter's long prompt is chunked too (into blocks, on the fused
    layers with the adapter's stacks): transformers + PEFT generate()'s tokens."""
    pytest.importorskip("peft")
    from tests.stages.test_lora import _reference, make_adapter

    peft_model = make_adapter(tiny_model_dir, tmp_path / "adapter", seed=7)
    torch_engine = _fused(tiny_model_dir, engine_device, budget=16)
    torch_engine.load_lora("adapter", tmp_path / "adapter")
    engine = TorchHopEngine("encode+prefill+decode", torch_engine, max_batch=4)
    stage: HopStage[Any] = HopStage(engine.role, engine, "tiny")
    processor = Processor(load_traits(resolve_model(str(tiny_model_dir), "tiny")))
    words = TextPart(" ".join(f"word{i}" for i in range(40)))
    asked = GenerateRequest("c4", "tiny", [ChatMessage("user", [words])], SamplingParams(N, 0.0, min_tokens=N))
    req = msgspec.structs.replace(processor.process(asked), lora="adapter")
    await engine.start()
    try:
        ctx = HopContext()
        tokens = await _stream(stage, req, ctx)
    finally:
        await engine.close()
    assert ctx.trace["prefill_chunks"] == -(-len(req.prompt_token_ids) // 16)
    assert tokens == _reference(tiny_model_dir, peft_model, req.prompt_token_ids, [], N)
    assert tokens != reference_generate(tiny_model_dir, req.prompt_token_ids, [], N)


async def test_a_long_prompt_given_up_between_mixed_steps_leaves_only_the_running_blocks(
    tiny_model_dir: Path, engine_device: str
) -> None:
    """Its client gone while a step carries its second chunk: no chunk of it
    runs after, its blocks go back, and the running stream goes on to
    generate()'s tokens."""
    torch_engine = _fused(tiny_model_dir, engine_device, budget=16)
    engine = TorchHopEngine("encode+prefill+decode", torch_engine, max_batch=4)
    stage: HopStage[Any] = HopStage(engine.role, engine, "tiny")
    processor = Processor(load_traits(resolve_model(str(tiny_model_dir), "tiny")))
    count = GenerateRequest(
        "m2", "tiny", [ChatMessage("user", [TextPart("Count with me")])], SamplingParams(120, 0.0, min_tokens=120)
    )
    words = TextPart(" ".join(f"word{i}" for i in range(40)))
    long = processor.process(GenerateRequest("m3", "tiny", [ChatMessage("user", [words])], SamplingParams(N, 0.0)))
    running = processor.process(count)
    gate, carried = threading.Event(), 0
    real = torch_engine.launch

    def gated(seqs: list[Any], chunk: Any = None) -> Any:
        nonlocal carried
        if chunk is not None:
            carried += 1
            if carried == 2:
                gate.wait(30)  # the step carrying the second chunk waits while the client goes
        return real(seqs, chunk=chunk)

    torch_engine.launch = gated  # type: ignore[method-assign]
    pool = torch_engine.decoder.pool
    await engine.start()
    try:
        first = asyncio.ensure_future(_stream(stage, running, HopContext()))
        await eventually(lambda: pool.num_free < pool.capacity, within=10.0)  # the first request is decoding
        task = asyncio.ensure_future(_stream(stage, long, HopContext()))
        await eventually(lambda: carried >= 2, within=10.0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()
        tokens = await first
        await eventually(lambda: pool.num_free == pool.capacity, within=10.0)
    finally:
        gate.set()
        await engine.close()
    assert carried == 2  # no chunk after the client went
    assert tokens == reference_generate(tiny_model_dir, running.prompt_token_ids, [], 120)


async def test_a_last_chunks_sequence_whose_caller_is_cancelled_as_it_comes_is_released(
    tiny_model_dir: Path, engine_device: str
) -> None:
    """The decode loop hands the last chunk's sequence over and its caller is
    cancelled before it wakes to take it: the loop releases the sequence
    (else its blocks and its decoder row stay taken for good)."""
    torch_engine = _fused(tiny_model_dir, engine_device, budget=16)
    engine = TorchHopEngine("encode+prefill+decode", torch_engine, max_batch=4)
    scheduler = engine.scheduler
    assert scheduler is not None and torch_engine.decoder is not None
    pool = torch_engine.decoder.pool
    prompt = list(torch_engine.tokenizer(" ".join(f"word{i}" for i in range(40)))["input_ids"])
    prefilling = torch_engine.start_prefill(prompt, [], greedy(N))
    caller: asyncio.Future[Any] | None = None
    real = scheduler._chunk_done

    def done(chunk: Any, out: Any) -> None:
        real(chunk, out)  # the caller's result is set here; it wakes only later
        if out is not None and caller is not None:
            caller.cancel()

    scheduler._chunk_done = done  # type: ignore[method-assign]

    async def every_chunk() -> Any:
        out = None
        while out is None:
            out = await scheduler.prefill_chunk(prefilling)
        return out

    await engine.start()
    try:
        caller = asyncio.ensure_future(every_chunk())
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert prefilling.done == prefilling.length  # the last chunk ran
        await eventually(lambda: pool.num_free == pool.capacity, within=10.0)
    finally:
        await engine.close()


def test_a_lone_sequence_swapped_out_for_a_waiting_prompts_blocks_launches_no_step_then_lets_it_run(
    tiny_model_dir: Path, engine_device: str
) -> None:
    """One decoder row, and a chunked prompt that took all but the pool's
    spare block and waits for the row: the running sequence, out of room,
    is swapped out (the youngest of its own step), and with no row held by
    anyone its launch queues nothing (it used to launch a step of no rows,
    which raised and failed the request). Then, first in line, it is short
    of blocks that the prompt behind it holds: the prompt, its cache in its
    blocks already, goes first (it used to wait behind it, and the two
    waited on each other for ever; seen under `--kv-cache-memory` small
    enough for one conversation). Both streams are generate()'s."""
    engine = _fused(tiny_model_dir, engine_device, budget=32, slots=1, kv_cache_memory=str(33 * 8192))
    pool = engine.decoder.pool
    words = list(engine.tokenizer(" ".join(f"w{i}" for i in range(400)))["input_ids"])
    first = words[:150]  # ten blocks: more than the pool's spare, to come back into
    [(running, _)] = engine.prefill([first], [[]], [greedy(40)])
    prompt = words[150:][: (pool.num_free - engine._spare()) * engine.block_size - 4]
    _, waiting, _ = _chunked(engine, prompt, N)
    assert waiting.slot < 0 and len(waiting.blocks) == engine.decoder.blocks_for(len(prompt))
    tokens: list[int | None] = []
    for _ in range(64):
        launch = engine.launch([running])
        assert launch is not None
        tokens = engine.collect(launch)
        if running.slot < 0:
            break
    assert running.slot < 0 and running.swapped and launch.launched is None and tokens == [None]
    # Another long prompt's first chunk takes the blocks the swapped one gave back.
    third = words[150 + len(prompt) :][: (pool.num_free - engine._spare()) * engine.block_size - 4]
    prefilling = engine.start_prefill(third, [], greedy(N))
    assert engine.prefill_chunk(prefilling) is None and pool.num_free == engine._spare()
    assert engine.admissible([running, waiting]) == [False, True]
    assert _decoded(engine, waiting, N) == reference_generate(tiny_model_dir, prompt, [], N)
    out = None
    while out is None:
        out = engine.prefill_chunk(prefilling)
    later = out[0]
    assert _decoded(engine, later, N) == reference_generate(tiny_model_dir, third, [], N)
    assert engine.admissible([running]) == [True]
    assert _decoded(engine, running, 40) == reference_generate(tiny_model_dir, first, [], 40)
    assert pool.num_free == pool.capacity
