"""The engine's one thread (stages/torch_engine/scheduler.py): calls run one
at a time, the decode loop's steps before whatever else waits, the rest in
submission order; with the real tiny engine, a decode loop keeps stepping
between the other calls queued behind it."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from stages.models import builtin_path
from stages.sampling import SamplingConfig
from stages.torch_engine.engine import TorchEngine
from stages.torch_engine.scheduler import DecodeScheduler, EngineThread


async def eventually(check: Callable[[], bool], within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


def blocker(thread: EngineThread) -> tuple[threading.Event, threading.Event]:
    """A call that holds the thread until its gate opens."""
    running, gate = threading.Event(), threading.Event()

    def hold() -> None:
        running.set()
        gate.wait(10)

    thread.submit(hold)
    return running, gate


async def test_an_urgent_call_runs_before_the_calls_waiting_ahead_of_it() -> None:
    thread = EngineThread()
    order: list[str] = []
    running, gate = blocker(thread)
    assert await asyncio.to_thread(running.wait, 5)
    calls = [
        asyncio.ensure_future(thread.call(order.append, "prefill a")),
        asyncio.ensure_future(thread.call(order.append, "prefill b")),
        asyncio.ensure_future(thread.call(order.append, "step", urgent=True)),
    ]
    await asyncio.sleep(0.05)
    assert order == []  # all three wait behind the held thread
    gate.set()
    await asyncio.gather(*calls)
    assert order == ["step", "prefill a", "prefill b"]
    thread.close()


async def test_close_runs_what_is_queued_then_takes_nothing_more() -> None:
    thread = EngineThread()
    order: list[int] = []
    running, gate = blocker(thread)
    assert await asyncio.to_thread(running.wait, 5)
    for i in range(5):
        thread.submit(order.append, i)
    gate.set()
    await asyncio.to_thread(thread.close)
    assert order == [0, 1, 2, 3, 4]
    with pytest.raises(RuntimeError, match="closed"):
        thread.submit(order.append, 5)


async def test_an_error_reaches_its_caller_and_the_thread_goes_on() -> None:
    thread = EngineThread()

    def fail() -> None:
        raise ValueError("bad job")

    with pytest.raises(ValueError, match="bad job"):
        await thread.call(fail)
    assert await thread.call(lambda: 7) == 7
    thread.close()


async def test_a_result_whose_caller_left_is_released() -> None:
    thread = EngineThread()
    released: list[str] = []
    running, gate = threading.Event(), threading.Event()

    def allocate() -> str:
        running.set()
        gate.wait(10)
        return "slot 3"

    task = asyncio.ensure_future(thread.call_or_release(released.append, allocate))
    assert await asyncio.to_thread(running.wait, 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    gate.set()
    await eventually(lambda: released == ["slot 3"])
    thread.close()


async def test_a_decode_loop_steps_between_the_other_calls_queued_behind_it(
    mmpipe_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Five slow calls queued at once (five requests' prefills, say) do not
    hold a running sequence's tokens for their sum: a step runs after each."""
    engine = TorchEngine(builtin_path("tiny-qwen2-vl"))
    thread = EngineThread()
    scheduler = DecodeScheduler(engine, thread)
    scheduler.start()
    log: list[str] = []
    for name in ("step", "launch"):  # the loop launches ahead where it can, else steps
        real = getattr(engine, name)

        def logged(seqs: list[Any], real: Callable[[list[Any]], Any] = real) -> Any:
            log.append("step")
            return real(seqs)

        monkeypatch.setattr(engine, name, logged)
    greedy = SamplingConfig(temperature=0.0, max_tokens=40, min_tokens=40)
    [(seq, first)] = await thread.call(engine.prefill, [engine.tokenizer("Count:")["input_ids"]], [[]], [greedy])
    tokens = [first]

    async def consume() -> None:
        async for token in scheduler.stream(seq, lambda _: len(tokens) + 1 >= 40):
            tokens.append(token)

    consumer = asyncio.ensure_future(consume())
    await eventually(lambda: log.count("step") >= 2)

    def slow(i: int) -> None:
        time.sleep(0.1)
        log.append(f"slow {i}")

    await asyncio.gather(*(thread.call(slow, i) for i in range(5)))
    await consumer
    slow_at = [i for i, entry in enumerate(log) if entry.startswith("slow")]
    assert len(slow_at) == 5
    # In submission order, every step would wait for all five (none between
    # the first and the last); the loop resubmits within a slow call's time,
    # so its steps go in between (each gap, unless this machine stalls).
    between = log[slow_at[0] : slow_at[-1]].count("step")
    assert between >= 2, log
    await scheduler.close()
    thread.close()
    assert len(tokens) == 40
