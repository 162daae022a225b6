"""The built-in engine's sleep mode (vLLM's): level 1 frees the KV pool
(and would move the weights to host memory on a GPU), level 2 drops the
weights; waking rebuilds what went, and the tokens are those of before."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from schemas.chunk import TokenChunk
from schemas.request import ChatMessage, GenerateRequest, SamplingParams
from stages.contract import HopContext
from stages.hop import HopStage
from stages.models import resolve_model
from stages.models.traits import load_traits
from stages.processor import Processor
from stages.sampling import SamplingConfig
from stages.torch_engine.engine import TorchEngine
from stages.torch_engine.hop_engine import TorchHopEngine
from stages.torch_engine.reference import reference_generate
from tests.polling import eventually
from tests.stages.engine_helpers import engine_on

N = 8


def _answer(engine: TorchEngine, prompt: list[int]) -> list[int]:
    [(seq, first)] = engine.prefill([prompt], [[]], [SamplingConfig(max_tokens=N, min_tokens=N)])
    out = [first]
    while len(out) < N:
        out += engine.step([seq])
    engine.release(seq)
    return out


def test_sleep_frees_the_kv_pool_or_the_weights_and_waking_gives_the_same_tokens(tiny_model_dir: Path) -> None:
    engine = engine_on("cpu", tiny_model_dir)
    prompt = list(engine.tokenizer("The sea and the mountains are")["input_ids"])
    expected = reference_generate(tiny_model_dir, prompt, [], N)
    assert _answer(engine, prompt) == expected
    held = engine.held_bytes()
    assert held["weights"] > 0 and held["kv_cache"] > 0
    assert engine.decoder is not None
    pool = weakref.ref(engine.decoder.keys)

    # Level 1: the pool is freed (on a CPU the weights are in host memory already).
    assert engine.sleep(1) == held
    gc.collect()
    assert pool() is None and engine.held_bytes() == {"weights": held["weights"], "kv_cache": 0}
    with pytest.raises(RuntimeError, match="sleeps already"):
        engine.sleep(2)
    engine.wake_up()
    assert engine.held_bytes() == held and engine.sleeping == 0
    assert _answer(engine, prompt) == expected

    # Level 2: the weights go too, and come back from the checkpoint.
    weight = weakref.ref(next(engine.model.parameters()))
    engine.sleep(2)
    gc.collect()
    assert weight() is None and engine.held_bytes() == {"weights": 0, "kv_cache": 0}
    engine.wake_up()
    assert engine.held_bytes() == held
    assert _answer(engine, prompt) == expected


def test_sleep_refuses_while_a_sequence_holds_the_pool_or_a_level_it_does_not_know(tiny_model_dir: Path) -> None:
    engine = engine_on("cpu", tiny_model_dir)
    prompt = list(engine.tokenizer("Hi")["input_ids"])
    [(seq, _)] = engine.prefill([prompt], [[]], [SamplingConfig(max_tokens=4)])
    engine.step([seq])  # in the batch decoder's pool now
    with pytest.raises(RuntimeError, match="hold the KV cache"):
        engine.sleep(1)
    engine.release(seq)
    with pytest.raises(ValueError, match="sleep level 3"):
        engine.sleep(3)
    assert engine.sleeping == 0 and engine.held_bytes()["kv_cache"] > 0


def _processed(tiny_model_dir: Path, rid: str, tokens: int) -> Any:
    processor = Processor(load_traits(resolve_model(str(tiny_model_dir), "tiny")))
    sampling = SamplingParams(tokens, 0.0, min_tokens=tokens)
    return processor.process(GenerateRequest(rid, "tiny", [ChatMessage("user", "Count to ten.")], sampling))


async def test_sleep_waits_for_a_prefill_whose_caller_left_to_release_its_sequence(tiny_model_dir: Path) -> None:
    """A worker going to sleep hands its requests back first: a prefill
    queued on the engine thread when its caller is cancelled still runs and
    makes a sequence, which a release queued after it frees. Sleep, asked
    for at that moment, goes after the release, not between the two (the
    release would then run on a sleeping engine)."""
    role = "encode+prefill+decode"
    engine = TorchHopEngine(role, TorchEngine(tiny_model_dir))
    stage = HopStage(role, engine, "tiny")
    request = _processed(tiny_model_dir, "s1", 4)
    released_asleep: list[int] = []
    release = engine.torch.release

    def observed(seq: Any) -> None:
        if engine.torch.sleeping:
            released_asleep.append(seq.prompt_len)
        release(seq)

    engine.torch.release = observed  # type: ignore[method-assign]
    await stage.start()
    try:
        busy, gate = threading.Event(), threading.Event()

        def occupied() -> None:
            busy.set()
            gate.wait(10)

        blocker = asyncio.ensure_future(engine.thread.call(occupied))
        assert await asyncio.to_thread(busy.wait, 5)
        run = asyncio.ensure_future(anext(aiter(stage.run(request, HopContext()))))
        await eventually(lambda: engine.thread.unsettled == 1, within=5.0)  # its prefill queued behind the blocker
        asleep = await _sleep_once_cancelled(engine, run)  # waiting for the prefill and its release
        gate.set()
        await blocker
        held = await asyncio.wait_for(asleep, 10)
        assert held["kv_cache"] > 0 and engine.torch.sleeping == 1
        await engine.thread.call(lambda: None)  # anything queued behind the sleep has run
        assert released_asleep == [] and engine.thread.unsettled == 0
        await engine.wake_up()
        tokens = [t async for c in stage.run(request, HopContext()) if isinstance(c, TokenChunk) for t in c.token_ids]
        assert tokens == reference_generate(tiny_model_dir, request.prompt_token_ids, [], 4)
    finally:
        await stage.close()


async def test_sleep_waits_for_a_sequence_joining_the_decode_loop(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefilled sequence waiting for the decode loop's next step holds no
    row of the pool yet; that step, queued before the sleep, gives it one,
    and its release (its caller gone) comes after the step. Sleep asked for
    while the step is on its way waits for both: it does not find the row
    held and fail."""
    role = "encode+prefill+decode"
    engine = TorchHopEngine(role, TorchEngine(tiny_model_dir))
    stage = HopStage(role, engine, "tiny")
    request = _processed(tiny_model_dir, "s2", 6)
    stepping, gate = threading.Event(), threading.Event()
    for name in ("step", "launch"):  # the loop launches ahead where it can, else steps
        real = getattr(engine.torch, name)

        def held_at_first(seqs: list[Any], real: Callable[[list[Any]], Any] = real) -> Any:
            stepping.set()
            gate.wait(10)  # the step that would admit the sequence, held before it runs
            return real(seqs)

        monkeypatch.setattr(engine.torch, name, held_at_first)
    await stage.start()
    try:

        async def consume() -> None:
            async for _ in stage.run(request, HopContext()):
                pass

        run = asyncio.ensure_future(consume())
        assert await asyncio.to_thread(stepping.wait, 10)
        asleep = await _sleep_once_cancelled(engine, run)  # waiting for the step and the release
        gate.set()
        held = await asyncio.wait_for(asleep, 10)
        assert held["kv_cache"] > 0 and engine.torch.sleeping == 1
        await engine.wake_up()
        tokens = [t async for c in stage.run(request, HopContext()) if isinstance(c, TokenChunk) for t in c.token_ids]
        assert tokens == reference_generate(tiny_model_dir, request.prompt_token_ids, [], 6)
    finally:
        await stage.close()


async def _sleep_once_cancelled(engine: TorchHopEngine, run: asyncio.Future[Any]) -> asyncio.Future[dict[str, int]]:
    """The hop's caller gone before its sequence holds a row of the pool,
    then sleep asked for: still waiting a moment later."""
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert engine.torch.holding == 0
    asleep = asyncio.ensure_future(engine.sleep(1))
    await asyncio.sleep(0.05)
    assert not asleep.done()
    return asleep
