"""``mmpipe bench``: numbers a user can reproduce with one command.

Three benchmarks, each in its own module so that the CLI imports only what
the chosen one needs:

- ``load``: the bridge under a fixed load from the official openai client
  (TTFT, ITL, end-to-end latency, tokens/s, requests/s), against any running
  deployment.
- ``modes``: the same load on each deployment mode in turn (``mmpipe up`` as
  a subprocess, one stack at a time), as ratios to the aggregated mode.
- ``transport``: tensor transfer throughput between two OS processes, next
  to an in-process memcpy of the same bytes measured in the same run, so the
  number says how close a transport gets to what the memory can do.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """uvloop when installed (as the workers and the bridge run), else asyncio."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def median_seconds(fn: Callable[[], Any], repeats: int, sync: Callable[[], Any]) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` (each waited for with
    ``sync``), after one unmeasured call: kernels chosen, allocator grown."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main(args: argparse.Namespace) -> int:
    if getattr(args, "compare_url", "") and (
        args.bench_command or args.workload != "single" or args.compare_deployments or args.compare_modes
    ):
        raise SystemExit("mmpipe bench: --compare-url splits one load over two running stacks; it runs alone")
    if args.bench_command == "scale":
        from pipeline.bench.scale import main as scale_main

        return scale_main(args)
    if args.bench_command == "decode":
        from pipeline.bench.decode import main as decode_main

        return decode_main(args)
    if args.bench_command == "encode":
        from pipeline.bench.encode import main as encode_main

        return encode_main(args)
    if args.bench_command == "images":
        from pipeline.bench.images import main as images_main

        return images_main(args)
    if args.bench_command == "kernels":
        from pipeline.bench.kernels import main as kernels_main

        return kernels_main(args)
    if args.bench_command == "transport":
        from pipeline.bench.transport import main as transport_main

        return transport_main(args)
    if getattr(args, "workload", "single") == "multiturn":
        from pipeline.bench.multiturn import main as multiturn_main

        return multiturn_main(args)
    if args.compare_deployments:
        from pipeline.bench.deployments import main as deployments_main

        return deployments_main(args)
    if args.compare_modes:
        from pipeline.bench.modes import main as modes_main

        return modes_main(args)
    from pipeline.bench.load import main as load_main

    return load_main(args)
