"""``mmpipe bench scale``: what one more worker of a role, and what
replicated streams, cost or gain.

- Workers: the same load on ``mmpipe up --mode M --workers ROLE=N`` for each
  N in turn (one stack at a time, as ``--compare-modes`` runs them), and
  each N's throughput as a ratio to one worker. On a host with fewer cores
  than processes, the ratio says how the host's cores are shared, not how the
  role scales: the table prints the host's core count beside it.
- Replication: a 3-node NATS cluster on loopback (pipeline.nats_cluster), the
  same load with R1 and with R3 streams on it, in the same run (each in its
  own namespace): what keeping three copies of every queue costs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from pipeline.bench import run_async
from pipeline.bench.load import LoadSpec, run_load, spec_from_args, synthetic_images
from pipeline.bench.modes import mmpipe_up
from pipeline.nats_cluster import LocalCluster
from schemas.routes import MODES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=sorted(MODES), default="e-p-d")
    p.add_argument("--role", default=None, help="the role to scale (default: the mode's last, which decodes)")
    p.add_argument("--workers", default="1,2,4", help="workers of the role, comma separated")
    p.add_argument("--replicas", default="1,3", help="stream replicas to compare on a 3-node cluster ('' to skip)")
    p.add_argument("--transport", choices=("auto", "nixl", "nats"), default="auto")


def _run(
    spec: LoadSpec, images: tuple[list[str], list[list[str]]], mode: str, transport: str, extra: tuple[str, ...]
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="mmpipe-bench-scale-") as tmp:
        started = time.monotonic()
        with mmpipe_up(mode, spec.model, transport, Path(tmp), spec.api_key, extra=extra) as (url, _):
            ready_s = time.monotonic() - started
            report = run_async(run_load(replace(spec, url=url, model=Path(spec.model).name), images))
    summary = report.summary()
    summary["ready_s"] = ready_s
    return summary


def _row(label: str, summary: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    ratio = summary["requests_per_s"] / base["requests_per_s"] if base["requests_per_s"] else None
    return {"run": label, "summary": summary, "req_s_ratio": ratio}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    spec = spec_from_args(args)
    images = synthetic_images(spec)
    role = args.role or MODES[args.mode][-1]
    if role not in MODES[args.mode]:
        raise SystemExit(f"--role {role}: mode {args.mode} has roles {', '.join(MODES[args.mode])}")
    workers: list[dict[str, Any]] = []
    for n in [int(w) for w in args.workers.split(",") if w.strip()]:
        print(f"{role} x{n}: starting ...", file=sys.stderr, flush=True)
        summary = _run(spec, images, args.mode, args.transport, ("--workers", f"{role}={n}"))
        workers.append(_row(f"{role} x{n}", summary, workers[0]["summary"] if workers else summary))
    replication: list[dict[str, Any]] = []
    replicas = [int(r) for r in args.replicas.split(",") if r.strip()]
    if replicas:
        with tempfile.TemporaryDirectory(prefix="mmpipe-bench-cluster-") as tmp:
            cluster = LocalCluster(Path(tmp))
            cluster.start()
            try:
                for r in replicas:
                    print(f"R{r} on a 3-node cluster: starting ...", file=sys.stderr, flush=True)
                    extra = ("--nats-url", cluster.url, "--replicas", str(r), "--namespace", f"r{r}")
                    summary = _run(spec, images, args.mode, args.transport, extra)
                    base = replication[0]["summary"] if replication else summary
                    replication.append(_row(f"R{r}", summary, base))
            finally:
                cluster.stop()
    return {"mode": args.mode, "role": role, "cores": os.cpu_count(), "workers": workers, "replication": replication}


def format_results(results: dict[str, Any]) -> str:
    head = f"mmpipe bench scale  mode={results['mode']}  role={results['role']}  host cores={results['cores']}"
    cols = ["run", "ok", "fail", "req/s", "tok/s", "TTFT p50 ms", "E2E p50 ms", "req/s x first"]
    table = [cols]
    for row in results["workers"] + results["replication"]:
        s = row["summary"]
        values = (s["requests_per_s"], s["tokens_per_s"], s["ttft_ms"]["p50"], s["e2e_ms"]["p50"], row["req_s_ratio"])
        formats = (".2f", ".1f", ".1f", ".1f", ".2f")
        cells = ["-" if v is None else format(v, f) for v, f in zip(values, formats, strict=True)]
        table.append([row["run"], str(s["completed"]), str(s["failed"]), *cells])
    widths = [max(len(line[i]) for line in table) for i in range(len(cols))]
    lines = [head, ""]
    for line in table:
        lines.append(
            "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True)))
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    try:
        results = measure(args)
    except RuntimeError as exc:  # a stack or the cluster did not start: the message says why
        print(f"mmpipe bench scale: {exc}", file=sys.stderr, flush=True)
        return 1
    print(json.dumps(results, indent=2) if args.json else format_results(results), flush=True)
    failed = sum(r["summary"]["failed"] for r in results["workers"] + results["replication"])
    return 1 if failed else 0
