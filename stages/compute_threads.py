"""Which threads of a worker run torch's CPU ops on several cores: the
engine's alone.

torch's CPU ops run their parallel parts on OpenMP (libgomp), where every
thread that runs a parallel op keeps a team of threads of its own. While
the teams' threads fit the process's cores, a team waits for its next op
spinning; once they do not, each op wakes its team from sleep. A worker's
main thread (the model's load), the threads that decode and preprocess
media and the event loop's helpers each kept a team, and so every small
op of the engine thread paid a wake: on 2 vCPUs a 32×64 by 64×256 matmul
took 0.08 ms instead of 0.008, a prefill of 30 tokens past a 1,568-token
cached prefix 7.4 ms instead of 5.4, a 1,569-token prompt 22.6 instead of
16.3 (tiny model, the engine called on a thread of its own).

So a worker ``reserve``s its intra-op threads for its engine threads
(``EngineThread`` enters them when it starts) and every other thread
computes on one: the main thread from then on, and each pool of helper
threads from its start (``one_thread`` as its initializer).

How long the engine's team spins before it sleeps is ``brief_spin``'s:
libgomp's default spin kept the team's threads busy between the engine's
steps, on the cores the bridge, NATS and the worker's loop share on a
small machine (2 vCPUs, tiny model, one user: a conversation's later
turn 20.7 to 21.5 ms to its first token where every thread's own team
gave 20.0; with the brief spin 16.1 to 16.2, and its first turn 40.7 to
42.3 ms -> 30.8 to 31.1).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

_engine_threads: int | None = None
# Whether the calling thread entered the engine's count (``enter_engine_thread``).
_thread = threading.local()

# libgomp's busy-wait iterations before a team's thread sleeps (its default:
# 300,000). Enough for the gap between two ops of one forward, not for the
# gap between two steps.
OPENMP_SPIN_COUNT = "10000"


def brief_spin() -> bool:
    """A worker process's OpenMP teams spin ``OPENMP_SPIN_COUNT`` times
    before they sleep, unless its environment says otherwise
    (``GOMP_SPINCOUNT``, ``OMP_WAIT_POLICY``). libgomp reads its
    environment once, when torch loads it: False where torch is loaded
    already. Processes the worker starts (an engine core) inherit it."""
    if "torch" in sys.modules:
        return False
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", OPENMP_SPIN_COUNT)
    return True


def reserve(threads: int | None) -> int:
    """At a worker's start, before its first torch op: ``threads`` (None:
    torch's default, one a core) for the engine's threads, one for the
    calling (main) thread. Returns the engine's count."""
    import torch

    global _engine_threads
    _engine_threads = threads if threads is not None else torch.get_num_threads()
    _this_thread(1)
    return _engine_threads


def enter_engine_thread() -> None:
    """On an engine thread, before its first op: the reserved threads
    (nothing where no worker reserved them: a test's or a bench's engine
    keeps torch's setting)."""
    if _engine_threads is not None:
        _this_thread(_engine_threads)
        _thread.engine = True


def engine_threads() -> int | None:
    """What ``reserve`` set aside (None: nothing reserved in this process)."""
    return _engine_threads


# A call of fewer floating-point operations than this runs on one of the
# engine's threads: on 2 vCPUs, after the idle between one client's requests,
# a prefill of 8 new tokens took 4.5 ms on one thread against 15.2 on two,
# 512 tokens 8.9 against 14.6, 1,024 14.8 against 10.6; a decode step of 16
# rows 14.6 against 9.0 (tiny model: 0.25 MFLOP a token, 19 a row of its
# 151,936-token head).
SMALL_CALL_FLOPS = 0.12e9
# Nor a call over a longer context than this: gathering and attending over
# a cached prefix is memory traffic that two threads share (one user's later
# turn, 30 new tokens past 1,568 cached: 7.66 ms on one thread against 7.11).
SMALL_CALL_PLACES = 512


@contextlib.contextmanager
def sized(flops: float) -> Iterator[None]:
    """On an engine thread: a call of fewer than ``SMALL_CALL_FLOPS`` on one
    thread. Its team's other threads, asleep after an idle, would be woken
    at each of its small ops to split work that one core does sooner, and
    their core is the one the bridge, NATS and the worker's loop share.

    In every process alike, reserved or not (a test's or a bench's engine
    beside a worker's): the count is the calling thread's own where nothing
    was reserved, so one call gives the same float32 bits wherever its
    engine runs."""
    if flops >= SMALL_CALL_FLOPS:
        yield
        return
    import torch

    # Where threads were reserved, a thread other than the engine's (a
    # small call run on its caller's thread, ``EngineThread._inline``)
    # computes on one already.
    if _engine_threads is not None and not getattr(_thread, "engine", False):
        yield
        return
    threads = _engine_threads if _engine_threads is not None else torch.get_num_threads()
    if threads <= 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def one_thread() -> None:
    """A helper thread's initializer: its torch ops on one core, no team.
    OpenMP's thread count is per thread; a new thread starts from the
    process's default, not from what its creator set."""
    if _engine_threads is not None:
        _this_thread(1)


def _this_thread(threads: int) -> None:
    """The calling thread's intra-op threads. OpenMP's count is the
    thread's own, but torch sets it in each thread once more at the thread's
    first parallel op, to the count any thread set last: that first op comes
    here, before this thread's own count."""
    import torch

    torch.get_num_threads()
    torch.set_num_threads(threads)


def helper_pool(prefix: str, max_workers: int | None = None) -> ThreadPoolExecutor:
    """A pool of helper threads, each computing on one core."""
    return ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=prefix, initializer=one_thread)


def reserve_on_loop(threads: int | None) -> int:
    """``reserve``, and the running loop's default executor (``asyncio.to_thread``'s
    threads: media decoding, digests, waits) a ``helper_pool``."""
    count = reserve(threads)
    asyncio.get_running_loop().set_default_executor(helper_pool("mmpipe-helper"))
    return count
