"""``mmpipe bench --compare-deployments``: the same cards, shared out in
different ways, under the same load.

Each deployment is one ``mmpipe up`` with ``--mode`` and ``--workers``
placing every worker on its device(s); they run one after another on the
same cards (``compare_stacks``). The baseline is ``replicas``: one
aggregated EPD worker per card, all taking from the same queues. The
others split the roles over the cards in given ratios, so a split has to
beat as many whole copies of the model on the same hardware, not one.
After each deployment's load a few greedy requests, one at a time, check
that it answers as the replicas do.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

from pipeline.bench.load import spec_from_args
from pipeline.bench.modes import StackSpec, compare_stacks, format_rows, parse_levels
from pipeline.launcher import parse_workers
from schemas.routes import MODES

BASELINE = "replicas"


@dataclass(frozen=True)
class Deployment:
    """A named ``mmpipe up --mode MODE --workers WORKERS``."""

    name: str
    mode: str
    workers: str

    def stack(self) -> StackSpec:
        return self.name, self.mode, ("--workers", self.workers)


def _on(devices: list[str]) -> str:
    return ",".join(devices)


def default_deployments(devices: list[str]) -> list[Deployment]:
    """Replicas (one EPD worker a card), then the splits these cards allow:
    E/PD with one encoder, EP/D half and half, E/P/D with one encoder and
    one prefill worker and the rest decoding (three cards or more)."""
    n = len(devices)
    if n < 1:
        raise ValueError("no devices to deploy on")
    out = [Deployment(BASELINE, "epd", f"encode+prefill+decode={n}@{_on(devices)}")]
    if n >= 2:
        rest = _on(devices[1:])
        out.append(Deployment(f"e-pd 1:{n - 1}", "e-pd", f"encode=1@{devices[0]},prefill+decode={n - 1}@{rest}"))
        half = n // 2
        out.append(
            Deployment(
                f"ep-d {half}:{n - half}",
                "ep-d",
                f"encode+prefill={half}@{_on(devices[:half])},decode={n - half}@{_on(devices[half:])}",
            )
        )
    if n >= 3:
        out.append(
            Deployment(
                f"e-p-d 1:1:{n - 2}",
                "e-p-d",
                f"encode=1@{devices[0]},prefill=1@{devices[1]},decode={n - 2}@{_on(devices[2:])}",
            )
        )
    return out


def parse_deployment(text: str) -> Deployment:
    """``NAME=MODE:WORKERS``, e.g. ``e-p-d 2:1:1=e-p-d:encode=2@cuda:0,cuda:1,prefill=1@cuda:2,decode=1@cuda:3``."""
    name, sep, rest = text.partition("=")
    mode, colon, workers = rest.partition(":")
    if not sep or not colon or not name.strip() or not workers.strip():
        raise SystemExit(f"--deployment {text!r}: NAME=MODE:WORKERS (WORKERS as `mmpipe up --workers` takes them)")
    if mode not in MODES:
        raise SystemExit(f"--deployment {text!r}: unknown mode {mode!r}; modes: {', '.join(MODES)}")
    parse_workers(workers, mode)  # exits with the reason where mmpipe up would
    return Deployment(name.strip(), mode, workers.strip())


def _devices(arg: str) -> list[str]:
    if arg:
        return [d.strip() for d in arg.split(",") if d.strip()]
    import torch

    count = torch.cuda.device_count()
    if not count:
        raise SystemExit("--compare-deployments: no CUDA device here; name the devices with --deploy-devices")
    return [f"cuda:{i}" for i in range(count)]


def format_answers(rows: list[dict[str, object]]) -> str:
    """A line per deployment: how many of its greedy answers are the replicas'."""
    seen: dict[str, str] = {}
    for row in rows:
        answers = row.get("answers")
        if isinstance(answers, list) and row["mode"] not in seen:
            seen[str(row["mode"])] = f"{row['same_answers']} of {len(answers)}"
    if not seen:
        return ""
    lines = ["", "", f"greedy answers (one request at a time) equal to the {BASELINE}':"]
    width = max(len(name) for name in seen)
    lines += [f"  {name.ljust(width)}  {same}" for name, same in seen.items()]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    given = [parse_deployment(text) for text in args.deployment]
    defaults = default_deployments(_devices(args.deploy_devices))
    # The replicas on the same cards are always the baseline; named splits replace the default ones.
    deployments = [defaults[0], *given] if given else defaults
    names = [d.name for d in deployments]
    if len(set(names)) != len(names):
        raise SystemExit(f"--deployment: names must differ: {', '.join(names)}")
    spec = spec_from_args(args)
    try:
        rows = compare_stacks(
            [d.stack() for d in deployments],
            spec,
            args.transport,
            args.api_key,
            parse_levels(args.concurrencies),
            args.device,
            tuple(args.up_arg),
            baseline=BASELINE,
            probes=args.probes,
        )
    except RuntimeError as exc:  # a stack that did not start: its log tail says why
        print(f"mmpipe bench --compare-deployments: {exc}", file=sys.stderr, flush=True)
        return 1
    if args.json:
        print(json.dumps(rows, indent=2), flush=True)
    else:
        print(format_rows(rows, "--compare-deployments") + format_answers(rows), flush=True)
    return 1 if any(row["summary"]["failed"] for row in rows) else 0
