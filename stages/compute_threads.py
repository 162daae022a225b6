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
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

_engine_threads: int | None = None


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


def engine_threads() -> int | None:
    """What ``reserve`` set aside (None: nothing reserved in this process)."""
    return _engine_threads


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
