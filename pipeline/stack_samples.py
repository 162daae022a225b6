"""Where a process's threads spend their time: their Python stacks, sampled
from inside the process.

For finding the serial path under load where an outside profiler cannot
attach (py-spy needs ptrace, which containers often withhold). A daemon
thread reads every other thread's current frame every ``interval_s`` and
counts each distinct stack; the file it writes holds one line per stack,
``thread;outermost;...;innermost count`` (the "folded" form flame-graph
tools read), rewritten every ``flush_s`` and at exit. A thread idle in a
wait shows as the wait's frame (``select``, ``wait``): its share of the
samples is the thread's idle time.

Samples say where a thread is, not whether it runs: one waiting for the
GIL looks like one in its own code or idle in C (uvloop's ``run`` is both).
So each sample is also weighed by the CPU time its thread used since the
last one (the thread's own CPU clock), written beside the samples as
``<file>.cpu`` in the same form, counts in microseconds: where a process
that is the wall (one core busy) spends its CPU. And how late the sampler
itself woke for each sample (``<file>.gil``, percentiles in ms and the
counts in 0.1 ms steps): it needs the GIL to take a sample, so lateness
near the 5 ms switch interval says the process's Python threads keep the
GIL busy, whatever their stacks say. Cost: one walk of each stack and one clock read per thread per
sample, some tens of microseconds every 5 ms.
"""

from __future__ import annotations

import atexit
import collections
import os
import sys
import threading
import time
from pathlib import Path

_MAX_DEPTH = 64
# The sampler's lateness is counted in steps of this many seconds, up to the last (and beyond, in it).
_LATE_STEP_S = 0.0001
_LATE_STEPS = 500


class StackSampler:
    def __init__(self, path: Path, interval_s: float = 0.005, flush_s: float = 10.0) -> None:
        self.path = path
        self.interval_s = interval_s
        self.flush_s = flush_s
        self.samples = 0
        self._counts: collections.Counter[str] = collections.Counter()
        self._cpu_us: collections.Counter[str] = collections.Counter()
        self._cpu_seen: dict[int, int] = {}
        # How late the wake-ups were, counted by _LATE_STEP_S, for the GIL's business.
        self._late = [0] * (_LATE_STEPS + 1)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()
        atexit.register(self.stop)

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=1.0)
        self.write()

    def _run(self) -> None:
        me = threading.get_ident()
        flushed = time.monotonic()
        woke = time.monotonic()
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            self._late[min(_LATE_STEPS, max(0, int((now - woke - self.interval_s) / _LATE_STEP_S)))] += 1
            names = {t.ident: t.name for t in threading.enumerate()}
            with self._lock:
                for ident, frame in sys._current_frames().items():
                    if ident != me:
                        stack = _folded(names.get(ident, str(ident)), frame)
                        self._counts[stack] += 1
                        used = self._cpu_since(ident)
                        if used:
                            self._cpu_us[stack] += used
                self.samples += 1
            if time.monotonic() - flushed >= self.flush_s:
                self.write()
                flushed = time.monotonic()
            woke = time.monotonic()

    def _cpu_since(self, ident: int) -> int:
        """Microseconds of CPU ``ident``'s thread used since the last sample."""
        try:
            now = time.clock_gettime_ns(time.pthread_getcpuclockid(ident)) // 1000
        except (OSError, AttributeError):  # gone meanwhile, or no per-thread clocks here
            return 0
        last = self._cpu_seen.get(ident)
        self._cpu_seen[ident] = now
        return now - last if last is not None else 0

    def write(self) -> None:
        with self._lock:
            lines = [f"{stack} {n}\n" for stack, n in self._counts.most_common()]
            cpu = [f"{stack} {n}\n" for stack, n in self._cpu_us.most_common()]
            late = list(self._late)
        gil = [f"{q} {_quantile(late, q / 100) * 1000:.1f}\n" for q in (50, 90, 99)] + [f"n {sum(late)}\n"]
        # The counts themselves: two files' difference is a stretch of the run (a load) alone.
        gil.append(f"counts {' '.join(map(str, late))}\n")
        for path, text in ((self.path, lines), (cpu_path(self.path), cpu), (gil_path(self.path), gil)):
            # Its own partial file: with_suffix would give .cpu and .gil the same one.
            partial = path.with_name(path.name + ".tmp")
            partial.write_text("".join(text))
            partial.replace(path)


def _quantile(counts: list[int], q: float) -> float:
    """The upper end of the step that holds the ``q`` quantile of ``counts`` (seconds)."""
    wanted, seen = q * sum(counts), 0
    for step, n in enumerate(counts):
        seen += n
        if n and seen >= wanted:
            return (step + 1) * _LATE_STEP_S
    return 0.0


def gil_path(path: Path) -> Path:
    """Where the sampler's lateness percentiles (ms) of the samples at ``path`` are."""
    return path.with_name(path.name + ".gil")


def cpu_path(path: Path) -> Path:
    """Where the CPU-weighted stacks of the samples at ``path`` are."""
    return path.with_name(path.name + ".cpu")


def _folded(thread: str, frame: object) -> str:
    # The innermost frame with its line (which statement is busy), the others
    # by function alone, so a stack's samples are not split line by line.
    code = frame.f_code  # type: ignore[attr-defined]
    frames = [f"{code.co_name} ({os.path.basename(code.co_filename)}:{frame.f_lineno})"]  # type: ignore[attr-defined]
    f: object | None = frame.f_back  # type: ignore[attr-defined]
    while f is not None and len(frames) < _MAX_DEPTH:
        code = f.f_code  # type: ignore[attr-defined]
        frames.append(f"{code.co_name} ({os.path.basename(code.co_filename)})")
        f = f.f_back  # type: ignore[attr-defined]
    frames.append(thread.replace(";", ":").replace(" ", "_"))
    return ";".join(reversed(frames))


def start(folder: str, process: str) -> StackSampler | None:
    """Sample this process's stacks into ``folder``/<process>-<pid>.folded."""
    if not folder:
        return None
    Path(folder).mkdir(parents=True, exist_ok=True)
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in process)
    sampler = StackSampler(Path(folder) / f"{safe}-{os.getpid()}.folded")
    sampler.start()
    return sampler


def summary(path: Path, top: int = 25) -> str:
    """Each thread's share of the samples, and its frames that hold the most
    samples (themselves or in what they call); then the same by CPU time
    where the ``.cpu`` file is there."""
    out = [_summary(path, top, "samples")]
    if cpu_path(path).exists():
        out.append(_summary(cpu_path(path), top, "CPU"))
    if gil_path(path).exists():
        late = dict(line.split(maxsplit=1) for line in gil_path(path).read_text().splitlines())
        out.append(
            f"-- the sampler woke late by p50 {late['50']} ms, p90 {late['90']}, p99 {late['99']} "
            f"over {late['n']} samples (near 5 ms: the GIL is busy)"
        )
    return "\n".join(out)


def _summary(path: Path, top: int, what: str) -> str:
    by_thread: collections.Counter[str] = collections.Counter()
    inclusive: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        by_thread[frames[0]] += int(count)
        for frame in set(frames[1:]):
            inclusive[frames[0]][frame] += int(count)
    total = sum(by_thread.values()) or 1
    out = [f"-- by {what}"]
    for thread, n in by_thread.most_common():
        amount = f"{n / 1e6:.2f} s of CPU" if what == "CPU" else f"{n} samples"
        out.append(f"{thread}: {amount} ({n / total:.1%})")
        for frame, m in inclusive[thread].most_common(top):
            out.append(f"  {m / n:6.1%}  {frame}")
    return "\n".join(out)


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(f"== {arg}")
        print(summary(Path(arg)))
