"""The engine's one thread (stages/torch_engine/scheduler.py): calls run one
at a time, in submission order, or with a step priority the decode loop's
steps ahead of the others once those had their share; with the real tiny
engine, where a decode loop's steps go between the other calls queued."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from stages.models import builtin_path
from stages.sampling import SamplingConfig
from stages.torch_engine.engine import TorchEngine
from stages.torch_engine.scheduler import DecodeScheduler, EngineThread
from tests.polling import eventually


def blocker(thread: EngineThread) -> tuple[threading.Event, threading.Event]:
    """A call that holds the thread until its gate opens."""
    running, gate = threading.Event(), threading.Event()

    def hold() -> None:
        running.set()
        gate.wait(10)

    thread.submit(hold)
    return running, gate


@pytest.mark.parametrize(
    ("others_s", "want"),
    [
        (None, ["prefill a", "prefill b", "step", "prefill c"]),  # submission order
        (0.0, ["step", "prefill a", "prefill b", "prefill c"]),  # steps first
        # The held call had 0.05 s of the thread: with 10 s to give, the others go on first.
        (10.0, ["prefill a", "prefill b", "prefill c", "step"]),
    ],
)
async def test_where_a_waiting_step_goes_among_the_other_calls(others_s: float | None, want: list[str]) -> None:
    thread = EngineThread(others_s)
    order: list[str] = []
    running, gate = blocker(thread)
    assert await asyncio.to_thread(running.wait, 5)
    calls = [
        asyncio.ensure_future(thread.call(order.append, "prefill a")),
        asyncio.ensure_future(thread.call(order.append, "prefill b")),
        asyncio.ensure_future(thread.call(order.append, "step", urgent=True)),
        asyncio.ensure_future(thread.call(order.append, "prefill c")),
    ]
    await asyncio.sleep(0.05)
    assert order == []  # all wait behind the held thread
    gate.set()
    await asyncio.gather(*calls)
    assert order == want
    thread.close()


async def test_a_step_goes_first_once_the_others_had_their_share() -> None:
    thread = EngineThread(0.15)
    order: list[str] = []
    running, gate = blocker(thread)
    assert await asyncio.to_thread(running.wait, 5)

    def slow(name: str) -> None:
        time.sleep(0.1)
        order.append(name)

    calls = [
        asyncio.ensure_future(thread.call(slow, "prefill a")),
        asyncio.ensure_future(thread.call(slow, "prefill b")),
        asyncio.ensure_future(thread.call(order.append, "step", urgent=True)),
        asyncio.ensure_future(thread.call(slow, "prefill c")),
    ]
    await asyncio.sleep(0.01)
    gate.set()  # the held call had about 0.01 s: less than the share
    await asyncio.gather(*calls)
    assert order == ["prefill a", "prefill b", "step", "prefill c"]  # 0.2 s >= 0.15 s after b
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
    assert thread.unsettled == 1  # what it allocates is still to come, and to go
    gate.set()
    await eventually(lambda: released == ["slot 3"], within=5.0)
    await eventually(lambda: thread.unsettled == 0, within=5.0)
    # A caller that stays, or a call that fails, settles too.
    assert await thread.call_or_release(released.append, lambda: "slot 4") == "slot 4"

    def fail() -> str:
        raise ValueError("no room")

    with pytest.raises(ValueError, match="no room"):
        await thread.call_or_release(released.append, fail)
    assert thread.unsettled == 0 and released == ["slot 3"]
    thread.close()


async def test_a_small_call_runs_on_its_callers_thread_while_the_engine_thread_is_idle() -> None:
    thread = EngineThread()
    here = threading.get_ident()
    engine_thread = await thread.call(threading.get_ident)
    inline = "mmpipe_engine_call_inline_total"
    before = _sample(inline, "get_ident", "")
    assert await thread.call_or_release(lambda _: None, threading.get_ident, small=True) == here
    assert _sample(inline, "get_ident", "") == before + 1
    # Not said to be small: the engine's thread, as ever.
    assert await thread.call_or_release(lambda _: None, threading.get_ident) == engine_thread
    assert thread.quiet
    thread.close()


async def test_a_small_call_waits_its_turn_behind_a_running_call_and_a_decoding_batch() -> None:
    thread = EngineThread()
    engine_thread = await thread.call(threading.get_ident)
    order: list[str] = []
    running, gate = blocker(thread)
    assert await asyncio.to_thread(running.wait, 5)
    queued = asyncio.ensure_future(thread.call(order.append, "queued"))
    await asyncio.sleep(0)

    def small() -> int:
        order.append("small")
        return threading.get_ident()

    after = asyncio.ensure_future(thread.call_or_release(lambda _: None, small, small=True))
    await asyncio.sleep(0.05)
    assert order == []  # neither ran beside the held call
    gate.set()
    assert await after == engine_thread
    await queued
    assert order == ["queued", "small"]
    # Sequences decoding: their next step must not wait for the caller's call.
    thread.decoding = lambda: True
    assert await thread.call_or_release(lambda _: None, threading.get_ident, small=True) == engine_thread
    thread.close()
    # A thread that keeps its calls in order on a device's stream takes them all.
    done = threading.Event()
    done.set()
    fenced = EngineThread(others_ahead=1, fence=lambda: HeldFence(done))
    fenced_thread = await fenced.call(threading.get_ident)
    assert await fenced.call_or_release(lambda _: None, threading.get_ident, small=True) == fenced_thread
    fenced.close()


async def test_a_call_submitted_from_another_thread_during_a_small_call_runs_after_it() -> None:
    thread = EngineThread()
    await thread.call(lambda: None)  # started, idle
    order: list[str] = []

    def small() -> bool:
        # Another thread (a NIXL callback, a release from a done future) submits meanwhile.
        other = threading.Thread(target=thread.submit, args=(order.append, "submitted"))
        other.start()
        other.join(0.2)
        time.sleep(0.05)  # time for the engine's thread to run it, were it in
        order.append("small")
        return other.is_alive()

    # Its submission waited for the small call's end.
    assert await thread.call_or_release(lambda _: None, small, small=True)
    await eventually(lambda: order == ["small", "submitted"], within=5.0)
    thread.close()


@pytest.mark.parametrize("others_s", [None, 0.0])
async def test_with_steps_first_a_decode_loop_steps_between_the_other_calls_queued(
    mmpipe_home: Path, monkeypatch: pytest.MonkeyPatch, others_s: float | None
) -> None:
    """Five slow calls queued at once (five requests' prefills, say): in
    submission order the running sequence's next token waits for all five;
    with steps first, the loop's steps go in between."""
    engine = TorchEngine(builtin_path("tiny-qwen2-vl"))
    thread = EngineThread(others_s)
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
    await eventually(lambda: log.count("step") >= 2, within=5.0)

    def slow(i: int) -> None:
        time.sleep(0.1)
        log.append(f"slow {i}")

    await asyncio.gather(*(thread.call(slow, i) for i in range(5)))
    await consumer
    slow_at = [i for i, entry in enumerate(log) if entry.startswith("slow")]
    assert len(slow_at) == 5
    # The loop resubmits its step within a slow call's time: steps first
    # puts it in each gap (at least two, unless this machine stalls).
    between = log[slow_at[0] : slow_at[-1]].count("step")
    if others_s is None:
        assert between == 0, log
    else:
        assert between >= 2, log
    await scheduler.close()
    thread.close()
    assert len(tokens) == 40


def _sample(metric: Any, call: str, suffix: str) -> float:
    value = REGISTRY.get_sample_value(f"{metric}{suffix}", {"call": call})
    return value or 0.0


async def test_each_call_s_wait_for_the_thread_and_its_run_are_recorded_by_name() -> None:
    thread = EngineThread()
    wait, run = "mmpipe_engine_call_wait_seconds", "mmpipe_engine_call_seconds"
    before = {
        (m, c, s): _sample(m, c, s) for m in (wait, run) for c in ("hold", "queued_behind") for s in ("_count", "_sum")
    }
    running, gate = blocker(thread)
    assert await asyncio.to_thread(running.wait, 5)

    def queued_behind() -> int:
        return 1

    behind = asyncio.ensure_future(thread.call(queued_behind))
    await asyncio.sleep(0)  # submitted
    held_from = time.perf_counter()
    await asyncio.sleep(0.05)
    held_s = time.perf_counter() - held_from
    gate.set()
    assert await behind == 1
    thread.close()

    def delta(metric: str, call: str, suffix: str) -> float:
        return _sample(metric, call, suffix) - before[(metric, call, suffix)]

    assert [delta(m, c, "_count") for m in (wait, run) for c in ("hold", "queued_behind")] == [1, 1, 1, 1]
    # Causal, not timed: the queued call could not start before the gate
    # opened, nor the held call end before it.
    assert delta(wait, "queued_behind", "_sum") >= held_s
    assert delta(run, "hold", "_sum") >= held_s


def _spin_cpu(seconds: float) -> None:
    """Busy on this thread's CPU until it has used ``seconds`` of it."""
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass


async def test_a_calls_time_on_the_cpu_is_told_from_its_time_waiting() -> None:
    """Of a call's run, the thread's CPU time: all of it for a call that
    computes, next to none for one that waits (as for the GIL or the GPU)."""
    thread = EngineThread()
    cpu, run = "mmpipe_engine_call_cpu_seconds", "mmpipe_engine_call_seconds"

    def computes() -> None:
        _spin_cpu(0.03)

    def waits() -> None:
        time.sleep(0.05)

    before = {(m, c, s): _sample(m, c, s) for m, s in ((cpu, "_total"), (run, "_sum")) for c in ("computes", "waits")}
    await thread.call(computes)
    await thread.call(waits)
    thread.close()

    def delta(metric: str, call: str, suffix: str) -> float:
        return _sample(metric, call, suffix) - before[(metric, call, suffix)]

    assert delta(cpu, "computes", "_total") >= 0.03
    assert delta(cpu, "computes", "_total") <= delta(run, "computes", "_sum") + 0.001
    assert delta(run, "waits", "_sum") >= 0.05
    assert delta(cpu, "waits", "_total") < 0.5 * delta(run, "waits", "_sum")


def test_each_python_threads_cpu_is_a_metric_by_its_name() -> None:
    import pipeline.metrics  # noqa: F401 (registers the collector)

    def named() -> float:
        return REGISTRY.get_sample_value("mmpipe_thread_cpu_seconds_total", {"thread": "test-spinner"}) or 0.0

    spun, stop = threading.Event(), threading.Event()

    def spinner() -> None:
        _spin_cpu(0.04)
        spun.set()
        stop.wait(10)

    worker = threading.Thread(target=spinner, name="test-spinner")
    worker.start()
    try:
        assert spun.wait(10)
        assert named() >= 0.04
    finally:
        stop.set()
        worker.join(10)
    assert named() == 0.0  # ended threads leave the metric


async def test_the_decode_loop_records_each_steps_rows_and_the_interval_between_hand_outs(
    mmpipe_home: Path,
) -> None:
    engine = TorchEngine(builtin_path("tiny-qwen2-vl"))
    thread = EngineThread()
    scheduler = DecodeScheduler(engine, thread)
    scheduler.start()

    def samples() -> list[float]:
        names = ["mmpipe_decode_batch_rows_count", "mmpipe_decode_batch_rows_sum"]
        names.append("mmpipe_decode_step_interval_seconds_count")
        return [REGISTRY.get_sample_value(n) or 0.0 for n in names]

    before = samples()
    greedy = SamplingConfig(temperature=0.0, max_tokens=20, min_tokens=20)
    [(seq, first)] = await thread.call(engine.prefill, [engine.tokenizer("Count:")["input_ids"]], [[]], [greedy])
    tokens = [first]
    async for token in scheduler.stream(seq, lambda _: len(tokens) + 1 >= 20):
        tokens.append(token)
    await scheduler.close()
    thread.close()
    steps, rows, intervals = (after - b for after, b in zip(samples(), before, strict=True))
    assert len(tokens) == 20
    # 19 tokens from the loop (one more step may have been launched ahead), one row each,
    # and an interval between each two hand-outs of one uninterrupted run.
    assert steps in (19, 20)
    assert rows == steps
    assert intervals == steps - 1


async def test_a_finished_sequence_is_released_with_the_next_step_and_when_idle_on_its_own(
    mmpipe_home: Path,
) -> None:
    """A sequence that ends while another runs gives its blocks back inside
    the decode loop's next call (no release call of its own); the last one
    with the collect of the step launched past its end, or in a call of its
    own; the pool whole again either way."""
    engine = TorchEngine(builtin_path("tiny-qwen2-vl"))
    assert engine.decoder is not None
    pool = engine.decoder.pool
    thread = EngineThread()
    scheduler = DecodeScheduler(engine, thread)
    scheduler.start()
    releases = _sample("mmpipe_engine_call_seconds", "release", "_count")
    prompt = engine.tokenizer("Count:")["input_ids"]

    async def decode(n: int) -> tuple[Any, list[int]]:
        greedy = SamplingConfig(temperature=0.0, max_tokens=n, min_tokens=n)
        [(seq, first)] = await thread.call(engine.prefill, [prompt], [[]], [greedy])
        tokens = [first]
        async for token in scheduler.stream(seq, lambda _: len(tokens) + 1 >= n):
            tokens.append(token)
        return seq, tokens

    free = pool.num_free
    long_run = asyncio.ensure_future(decode(60))
    short_seq, short = await decode(4)
    # The short one's blocks come back while the long one still steps.
    await eventually(lambda: short_seq.released, within=10)
    assert not long_run.done()
    assert _sample("mmpipe_engine_call_seconds", "release", "_count") == releases
    long_seq, tokens = await long_run
    assert len(short) == 4 and len(tokens) == 60
    await eventually(lambda: long_seq.released and pool.num_free == free, within=10)
    assert _sample("mmpipe_engine_call_seconds", "release", "_count") <= releases + 1
    await scheduler.close()
    thread.close()


async def test_a_release_that_fails_is_counted_and_the_step_it_rode_with_goes_on(mmpipe_home: Path) -> None:
    engine = TorchEngine(builtin_path("tiny-qwen2-vl"))
    thread = EngineThread()
    scheduler = DecodeScheduler(engine, thread)
    scheduler.start()
    prompt = engine.tokenizer("Count:")["input_ids"]
    release, failing = engine.release, []

    def release_or_fail(seq: Any) -> None:
        if seq in failing:
            raise RuntimeError("injected release failure")
        release(seq)

    engine.release = release_or_fail  # type: ignore[method-assign]
    failures = REGISTRY.get_sample_value("mmpipe_engine_release_failures_total") or 0.0

    async def decode(n: int, fails: bool) -> list[int]:
        greedy = SamplingConfig(temperature=0.0, max_tokens=n, min_tokens=n)
        [(seq, first)] = await thread.call(engine.prefill, [prompt], [[]], [greedy])
        if fails:
            failing.append(seq)
        tokens = [first]
        async for token in scheduler.stream(seq, lambda _: len(tokens) + 1 >= n):
            tokens.append(token)
        return tokens

    long_run = asyncio.ensure_future(decode(40, False))
    assert len(await decode(4, True)) == 4
    assert len(await long_run) == 40  # the steps after the failed release went on
    await eventually(lambda: (REGISTRY.get_sample_value("mmpipe_engine_release_failures_total") or 0.0) == failures + 1)
    await scheduler.close()
    thread.close()


async def test_a_calls_work_on_the_gpu_is_timed_by_its_span_there(engine_device: str) -> None:
    if engine_device == "cpu":
        pytest.skip("CUDA events time work on a GPU")
    import torch

    def gpu_spent() -> float:
        return REGISTRY.get_sample_value("mmpipe_engine_call_gpu_seconds_total", {"call": "matmuls"}) or 0.0

    def matmuls() -> None:
        # Launched, not waited for: the thread is done long before the device is.
        a = torch.randn(4096, 4096, device=engine_device)
        for _ in range(40):
            a = a @ a / 64

    before = gpu_spent()
    thread = EngineThread(gpu_spans=True)
    await thread.call(matmuls)
    torch.cuda.synchronize()
    await thread.call(lambda: None)  # read once a later call ends and the span's events have passed
    thread.close()
    # 40 products of 4096² (5.5 TFLOP) take milliseconds on any GPU; their launches microseconds.
    assert gpu_spent() - before > 0.001


class HeldFence:
    """A call's work on a "device" that finishes when the test says so
    (``done``: shared by every call's fence, or the fence's own)."""

    def __init__(self, done: threading.Event | None = None) -> None:
        self.done = done if done is not None else threading.Event()

    def query(self) -> bool:
        return self.done.is_set()


@pytest.mark.parametrize(
    ("ahead", "decoding", "run_at_once"), [(1, True, 1), (2, True, 2), (1, False, 3), (0, True, 3)]
)
async def test_while_sequences_decode_other_calls_wait_for_the_device_to_finish_the_earlier_ones(
    ahead: int, decoding: bool, run_at_once: int
) -> None:
    device_done = threading.Event()
    thread = EngineThread(0.0, others_ahead=ahead, fence=lambda: HeldFence(device_done))
    thread.decoding = lambda: decoding
    order: list[str] = []
    calls = [asyncio.ensure_future(thread.call(order.append, f"prefill {name}")) for name in "abc"]
    await eventually(lambda: len(order) == run_at_once, within=5.0)
    await asyncio.sleep(0.05)
    assert len(order) == run_at_once  # the rest held back while the device has the earlier ones' work
    # A step is not held back: it goes ahead of the waiting calls.
    await thread.call(order.append, "step", urgent=True)
    assert order[run_at_once] == "step" or run_at_once == 3
    device_done.set()
    await asyncio.gather(*calls)
    assert [o for o in order if o != "step"] == ["prefill a", "prefill b", "prefill c"]
    thread.close()


async def test_a_call_held_back_goes_once_the_sequences_stop_decoding() -> None:
    thread = EngineThread(0.0, others_ahead=1, fence=HeldFence)
    running = True
    thread.decoding = lambda: running
    order: list[str] = []
    await thread.call(order.append, "prefill a")
    waiting = asyncio.ensure_future(thread.call(order.append, "prefill b"))
    await asyncio.sleep(0.05)
    assert order == ["prefill a"]
    running = False
    await asyncio.wait_for(waiting, 5)
    assert order == ["prefill a", "prefill b"]
    thread.close()


async def test_on_a_gpu_a_call_held_back_starts_after_the_earlier_ones_work_is_done(engine_device: str) -> None:
    if engine_device == "cpu":
        pytest.skip("CUDA events mark a call's work done on a GPU")
    import torch

    thread = EngineThread(0.0, others_ahead=1)
    thread.decoding = lambda: True
    launched: list[Any] = []

    def matmuls() -> None:
        a = torch.randn(4096, 4096, device=engine_device)
        for _ in range(200):
            a = a @ a / 64
        event = torch.cuda.Event()
        event.record()
        launched.append(event)

    def second() -> bool:
        return bool(launched[0].query())

    first = asyncio.ensure_future(thread.call(matmuls))
    # Submitted together: the second starts only once the first's products (a second or so of work) are done.
    assert await thread.call(second)
    await first
    thread.close()
