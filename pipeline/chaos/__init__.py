"""``mmpipe chaos``: fault injection against a whole stack, with figures.

It starts its own stack (``stack.py``: an embedded nats-server, two workers
of every role as OS processes, the bridge), runs the scenarios of
``scenarios.py`` against it and prints a table (``figures.py``). The tests
(tests/e2e/test_chaos.py) run the same scenarios, so CI checks what this
command reports.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from pipeline.chaos.figures import Figures, table
from pipeline.config import ROUTERS


async def _run_all(stack: object, spec: object, reference: object, names: list[str]) -> list[Figures]:
    from pipeline.chaos.scenarios import RUNNERS, Run

    out = []
    async with Run(stack, spec, reference) as run:  # type: ignore[arg-type]
        for name in names:
            out.append(await RUNNERS[name](run))
    return out


def main(args: argparse.Namespace) -> int:
    from pipeline.bench import run_async
    from pipeline.chaos.reference import Reference
    from pipeline.chaos.scenarios import SCENARIOS, ChaosSpec
    from pipeline.chaos.stack import ChaosStack, StackOptions

    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    spec = ChaosSpec(concurrency=args.concurrency, requests=args.requests, max_tokens=args.max_tokens)
    options = StackOptions(
        mode=args.mode, model=args.model, transport=args.transport, ack_wait_s=args.ack_wait, router=args.router
    )
    with tempfile.TemporaryDirectory(prefix="mmpipe-chaos-") as tmp:
        with ChaosStack(args.data_dir or Path(tmp), options) as stack:
            print(
                f"mmpipe chaos: mode={options.mode} router={options.router} workers: {options.per_role} per role, "
                f"concurrency {spec.concurrency}, {spec.requests} requests, {spec.max_tokens} tokens",
                flush=True,
            )
            reference = Reference(stack.model_path)
            figures = run_async(_run_all(stack, spec, reference, names))
    print(table(figures), flush=True)
    return 0 if all(f.ok for f in figures) and all(f.missing_retry_after == 0 for f in figures) else 1


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    chaos = sub.add_parser("chaos", help="kill workers, restart NATS, overload: a stack of its own, figures printed")
    chaos.add_argument("--scenario", choices=("crash", "nats-restart", "overload", "all"), default="all")
    chaos.add_argument("--mode", default="e-p-d")
    chaos.add_argument("--router", choices=ROUTERS, default="round-robin", help="where hops that prefill go")
    chaos.add_argument("--model", default="tiny-qwen2-vl")
    chaos.add_argument("--transport", choices=("nixl", "nats"), default="nixl")
    chaos.add_argument("--concurrency", type=int, default=16)
    chaos.add_argument("--requests", type=int, default=64, help="requests per scenario")
    chaos.add_argument("--max-tokens", type=int, default=48)
    chaos.add_argument("--ack-wait", type=float, default=3.0, help="the stack's ack wait (seconds)")
    chaos.add_argument("--data-dir", type=Path, default=None, help="keep the store and every process's log here")
    chaos.add_argument("--log-level", default="ERROR")


__all__ = ["add_parser", "main"]
