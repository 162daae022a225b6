"""``--stack-samples``: where a process's threads are, and where its CPU
goes. A thread that computes and one that sleeps are sampled side by side:
both fill samples, only the first fills CPU time, in its own function; the
sampler's own lateness is kept (what a busy GIL shows as)."""

from __future__ import annotations

import collections
import threading
import time
from pathlib import Path

from pipeline.stack_samples import StackSampler, cpu_path, gil_path, summary


def _spin_until(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(i * i for i in range(2000))


def _sleep_until(stop: threading.Event) -> None:
    while not stop.is_set():
        time.sleep(0.001)


def _by_thread(path: Path) -> collections.Counter[str]:
    totals: collections.Counter[str] = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        totals[stack.split(";")[0]] += int(count)
    return totals


def _cpu_in(path: Path, thread: str, function: str) -> int:
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if frames[0] == thread and any(f.startswith(f"{function} ") for f in frames):
            total += int(count)
    return total


def test_cpu_time_goes_to_the_thread_and_function_that_computes(tmp_path: Path) -> None:
    path = tmp_path / "proc-1.folded"
    sampler = StackSampler(path, interval_s=0.002, flush_s=3600)
    stop = threading.Event()
    threads = [
        threading.Thread(target=_spin_until, args=(stop,), name="spinner"),
        threading.Thread(target=_sleep_until, args=(stop,), name="sleeper"),
    ]
    for t in threads:
        t.start()
    sampler.start()
    try:
        deadline = time.monotonic() + 30
        # Enough of both to tell them apart: 200 ms of the spinner's CPU.
        while True:
            sampler.write()
            cpu = _by_thread(cpu_path(path)) if cpu_path(path).exists() else collections.Counter()
            if cpu["spinner"] >= 200_000 and _by_thread(path)["sleeper"] >= 50:
                break
            assert time.monotonic() < deadline, f"too few samples: {cpu}"
            time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join()
        sampler.stop()
    cpu = _by_thread(cpu_path(path))
    # The sleeper wakes every millisecond: some CPU, far less than the spinner's.
    assert cpu["sleeper"] < cpu["spinner"] / 4
    assert _cpu_in(cpu_path(path), "spinner", "_spin_until") > 0.9 * cpu["spinner"]
    text = summary(path)
    assert "-- by samples" in text and "-- by CPU" in text
    assert "spinner: " in text.split("-- by CPU")[1]
    # How late the sampler woke: it competed for the GIL with the spinner.
    late = dict(line.split(maxsplit=1) for line in gil_path(path).read_text().splitlines())
    assert int(late["n"]) >= 50 and sum(map(int, late["counts"].split())) == int(late["n"])
    assert 0 <= float(late["50"]) <= float(late["90"]) <= float(late["99"])
    assert "woke late by p50" in text
