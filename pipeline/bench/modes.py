"""``mmpipe bench --compare-modes``: the same load on each deployment mode.

Each mode runs as a user would start it, ``mmpipe up --mode M`` in a
subprocess (its own nats-server, every worker its own OS process, the
bridge), one stack at a time so that two stacks never compete for the same
cores; it is stopped with SIGINT, as Ctrl-C would, before the next starts.
Every mode gets the same load, the same seeded images included, and the
table gives each mode's numbers as ratios to the aggregated mode (EPD):
what splitting the work into separate processes costs or gains here.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from pipeline.bench import run_async
from pipeline.bench.cpu import stack_cpu_s
from pipeline.bench.load import PROMPT, LoadSpec, at_concurrency, run_load, spec_from_args, synthetic_images
from pipeline.bench.results import figure
from pipeline.serve import resolve_device
from schemas.routes import MODES

BASELINE = "epd"
HF = "transformers"  # the plain-transformers baseline row (--hf-baseline)
READY = b"mmpipe ready"
# The columns compared with the baseline: (summary key, statistic or None for a scalar).
# --compare-frontend-decode: each mode without, then with, the media decoded where requests are processed.
VARIANTS = (("", ()), ("+frontend-decode", ("--frontend-decode",)))
RATIOS = (("ttft_ms", "p50"), ("itl_ms", "p50"), ("e2e_ms", "p50"), ("requests_per_s", None))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


@contextmanager
def mmpipe_up(
    mode: str,
    model: str,
    transport: str,
    data_dir: Path,
    api_key: str | None = None,
    start_timeout_s: float = 300,
    extra: tuple[str, ...] = (),
) -> Iterator[tuple[str, int]]:
    """``mmpipe up`` in ``mode`` (with ``extra`` flags) on a free port; yields the
    OpenAI base URL once it printed its ready line, and its process id; stops
    it with SIGINT when the block ends."""
    port = free_port()
    cmd = [sys.executable, "-m", "pipeline.cli", "up", "--mode", mode, "--port", str(port)]
    cmd += ["--data-dir", str(data_dir), "--model", model, "--served-model-name", Path(model).name]
    cmd += ["--transport", transport, "--log-level", "WARNING", *extra]
    if api_key:
        cmd += ["--api-key", api_key]
    log_path = data_dir / "up.log"
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log_file:
        up = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + start_timeout_s
        while READY not in log_path.read_bytes():
            if up.poll() is not None:
                raise RuntimeError(f"mmpipe up --mode {mode} exited with {up.returncode}:\n{_tail(log_path)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"mmpipe up --mode {mode} not ready in {start_timeout_s:.0f}s:\n{_tail(log_path)}")
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/v1", up.pid
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
        try:
            up.wait(90)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()


def ratios(summary: dict[str, Any], baseline: dict[str, Any]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key, stat in RATIOS:
        mine = summary[key][stat] if stat else summary[key]
        base = baseline[key][stat] if stat else baseline[key]
        out[f"{key}.{stat}" if stat else key] = mine / base if mine is not None and base else None
    return out


# A stack ``compare_stacks`` starts: its name in the table, its mode, and flags of its own for `mmpipe up`.
StackSpec = tuple[str, str, tuple[str, ...]]


def compare(
    modes: list[str],
    spec: LoadSpec,
    transport: str,
    api_key: str | None = None,
    concurrencies: list[int] | None = None,
    device: str = "auto",
    up_args: tuple[str, ...] = (),
    hf_baseline: bool = False,
    variants: tuple[tuple[str, tuple[str, ...]], ...] = (("", ()),),
) -> list[dict[str, Any]]:
    """One row per mode, variant and concurrency (``compare_stacks``), the
    ratios to plain transformers with ``hf_baseline``, else to EPD. A
    variant (a suffix of the mode's name and flags of its own) is a stack
    of its own."""
    stacks = [(mode + suffix, mode, flags) for mode in modes for suffix, flags in variants]
    return compare_stacks(stacks, spec, transport, api_key, concurrencies, device, up_args, hf_baseline)


def compare_stacks(
    stacks: list[StackSpec],
    spec: LoadSpec,
    transport: str,
    api_key: str | None = None,
    concurrencies: list[int] | None = None,
    device: str = "auto",
    up_args: tuple[str, ...] = (),
    hf_baseline: bool = False,
    baseline: str = BASELINE,
    probes: int = 0,
) -> list[dict[str, Any]]:
    """One row per stack and concurrency: its load summary, the CPU time its
    stack's processes spent on it (by role, per request), and its ratios to
    the baseline at the same concurrency (plain transformers with
    ``hf_baseline``, else the stack named ``baseline``, else the first).
    Each stack starts once and serves every concurrency; each concurrency
    gets images of its own (the embedding cache never hits), the same for
    every stack. ``probes``: that many greedy requests, one at a time,
    after a stack's load; their answers are on its rows (``answers``), and
    how many equal the baseline stack's (``same_answers``)."""
    levels = concurrencies or [spec.concurrency]
    loads = [(c, replace(at_concurrency(spec, c), seed=spec.seed + 1000 * i)) for i, c in enumerate(levels)]
    images = {c: synthetic_images(s) for c, s in loads}  # the very same bytes for every stack
    # The baseline runs where the workers do.
    device = resolve_device(device)
    extra = ("--device", device, *up_args)
    rows: list[dict[str, Any]] = []
    if hf_baseline:
        rows += _hf_rows(spec, loads, images, device)
    for name, mode, flags in stacks:
        print(f"mode {name}: starting mmpipe up ...", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(prefix=f"mmpipe-bench-{mode}-") as tmp:
            t0 = time.monotonic()
            up = mmpipe_up(mode, spec.model, transport, Path(tmp), api_key, extra=(*extra, *flags))
            with up as (url, pid):
                ready_s = time.monotonic() - t0
                print(f"mode {name}: ready in {ready_s:.1f} s, running the load ...", file=sys.stderr, flush=True)
                for c, load in loads:
                    # `up` serves the model under its directory's (or built-in) name.
                    served = replace(load, url=url, model=Path(spec.model).name)
                    # Unmeasured: c requests at c in flight, so what a batch of c
                    # sets up lazily (CUDA graphs of its size) is not in the numbers.
                    warm = replace(served, requests=c, seed=served.seed + 500)
                    run_async(run_load(warm, synthetic_images(warm)))
                    before = stack_cpu_s(pid)
                    report = run_async(run_load(served, images[c]))
                    after = stack_cpu_s(pid)
                    summary = report.summary()
                    done = max(summary["completed"], 1)
                    cpu = {role: 1000 * (after[role] - before.get(role, 0.0)) / done for role in after}
                    print(f"mode {name} concurrency {c}: {_progress(summary)}", file=sys.stderr, flush=True)
                    rows.append(
                        {
                            "mode": name,
                            "concurrency": c,
                            "transport": transport,
                            "summary": summary,
                            "cpu_ms_per_request": cpu,
                        }
                    )
                    if summary["failed"]:
                        # The stack's own log says why; its folder goes when the mode ends.
                        print(
                            f"mode {name}: mmpipe up's log ends\n{_tail(Path(tmp) / 'up.log', 6000)}", file=sys.stderr
                        )
                if probes:
                    # Images no load sent: no stack answers from its prefix cache.
                    fresh = replace(loads[0][1], url=url, model=Path(spec.model).name, seed=spec.seed + 700)
                    answers = run_async(greedy_answers(fresh, probes))
                    for row in rows:
                        if row["mode"] == name:
                            row["answers"] = answers
    names = [name for name, _, _ in stacks]
    base_mode = HF if hf_baseline else baseline if baseline in names else names[0]
    for row in rows:
        base = next(
            (r for r in rows if r["mode"] == base_mode and r["concurrency"] == row["concurrency"]),
            next(r for r in rows if r["concurrency"] == row["concurrency"]),
        )
        row["baseline"] = base["mode"]
        row["ratios"] = ratios(row["summary"], base["summary"])
    if probes:
        want: list[str] = next(
            (r["answers"] for r in rows if r["mode"] == (baseline if baseline in names else names[0])), []
        )
        for row in rows:
            if "answers" in row:
                row["same_answers"] = sum(a == b for a, b in zip(row["answers"], want, strict=True))
    return rows


async def greedy_answers(spec: LoadSpec, n: int) -> list[str]:
    """The text of ``n`` greedy answers of exactly ``spec.max_tokens``
    tokens, one request at a time (no batch shapes of their own): the
    load's first ``n`` requests, images and all."""
    import openai

    client = openai.AsyncOpenAI(base_url=spec.url, api_key=spec.api_key or "unused", timeout=spec.timeout_s)
    _, sets = synthetic_images(spec)
    out = []
    try:
        for urls in sets[:n]:
            content: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
            content.append({"type": "text", "text": PROMPT})
            messages: Any = [{"role": "user", "content": content}]
            reply = await client.chat.completions.create(
                model=spec.model,
                messages=messages,
                max_tokens=spec.max_tokens,
                temperature=0,
                extra_body={"min_tokens": spec.max_tokens},
            )
            out.append(reply.choices[0].message.content or "")
    finally:
        await client.close()
    return out


def _hf_rows(
    spec: LoadSpec, loads: list[tuple[int, LoadSpec]], images: dict[int, Any], device: str
) -> list[dict[str, Any]]:
    """The plain-transformers baseline, in this process: the first level's
    requests served once, one at a time, and each concurrency's closed loop
    made from those times (``generate()`` serves one request at a time, so
    the clients waiting change only how long each waits; serving every
    level again would cost minutes a level and tell nothing more)."""
    from pipeline.bench.hf_baseline import HfServer, closed_loop, serve_all
    from stages.models import resolve_model

    print("transformers: loading the model for generate() ...", file=sys.stderr, flush=True)
    server = HfServer(resolve_model(spec.model).path, device)
    first, load = loads[0]
    services = serve_all(server, load, images[first])
    rows = []
    for c, load in loads:
        summary = closed_loop(services, load).summary()
        print(f"transformers concurrency {c}: {_progress(summary)}", file=sys.stderr, flush=True)
        rows.append({"mode": HF, "concurrency": c, "transport": "-", "summary": summary})
    del server
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()  # the stacks that follow need the memory
    return rows


def _progress(summary: dict[str, Any]) -> str:
    """A level's figures as it ends: a run cut short keeps what it measured."""
    return (
        f"{summary['completed']} completed, {summary['failed']} failed; TTFT p50 "
        f"{figure(summary['ttft_ms']['p50'], '.1f')} ms, ITL p50 {figure(summary['itl_ms']['p50'], '.2f')} "
        f"p99 {figure(summary['itl_ms']['p99'], '.1f')} ms, {summary['requests_per_s']:.2f} req/s "
        f"({figure(summary.get('steady_requests_per_s'), '.2f')} with every client busy)"
    )


def format_rows(rows: list[dict[str, Any]], command: str = "--compare-modes") -> str:
    c = rows[0]["summary"]["config"]
    images = f"{c['images_per_request']}×{c['image_size']}" if c["images_per_request"] else "none"
    base = rows[0]["baseline"]
    levels = sorted({row["concurrency"] for row in rows})
    per_client = c.get("requests_per_client", 0)
    requests = f"{per_client} per client" if per_client else str(c["requests"])
    head = (
        f"mmpipe bench {command}  transport={rows[-1]['transport']}  model={c['model']}  "
        f"concurrency={','.join(map(str, levels))}  requests={requests}  max_tokens={c['max_tokens']}  "
        f"images={images}"
    )
    cols = ["mode", "conc", "ok", "fail", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms"]
    cols += ["E2E p50 ms", "E2E p99 ms", "req/s", "busy req/s", "tok/s"]
    cols += [f"TTFT ×{base}", f"ITL ×{base}", f"E2E ×{base}", f"req/s ×{base}"]
    table = [cols]
    for row in rows:
        s, r = row["summary"], row["ratios"]
        table.append(
            [
                row["mode"],
                str(row["concurrency"]),
                str(s["completed"]),
                str(s["failed"]),
                figure(s["ttft_ms"]["p50"], ".1f"),
                figure(s["ttft_ms"]["p99"], ".1f"),
                figure(s["itl_ms"]["p50"], ".1f"),
                figure(s["itl_ms"]["p99"], ".1f"),
                figure(s["e2e_ms"]["p50"], ".1f"),
                figure(s["e2e_ms"]["p99"], ".1f"),
                figure(s["requests_per_s"], ".2f"),
                figure(s.get("steady_requests_per_s"), ".2f"),
                figure(s["tokens_per_s"], ".1f"),
                figure(r["ttft_ms.p50"], ".2f"),
                figure(r["itl_ms.p50"], ".2f"),
                figure(r["e2e_ms.p50"], ".2f"),
                figure(r["requests_per_s"], ".2f"),
            ]
        )
    widths = [max(len(line[i]) for line in table) for i in range(len(cols))]
    lines = [head, ""]
    for line in table:
        lines.append(
            "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths, strict=True))
            )
        )
    lines += _cpu_lines(rows)
    errors = [(row["mode"], e, n) for row in rows for e, n in row["summary"]["errors"].items()]
    if errors:
        lines += ["", "errors:"] + [f"  {mode}: {n} × {e}" for mode, e, n in errors]
    return "\n".join(lines)


def _cpu_lines(rows: list[dict[str, Any]]) -> list[str]:
    """CPU ms per request of each role's processes (a worker's with its media pool's), row by row."""
    measured = [row for row in rows if row.get("cpu_ms_per_request")]
    if not measured:
        return []
    roles = sorted({role for row in measured for role in row["cpu_ms_per_request"]} - {"up"})
    table = [["mode", "conc", *roles]]
    for row in measured:
        cpu = row["cpu_ms_per_request"]
        table.append([row["mode"], str(row["concurrency"]), *(figure(cpu.get(role), ".2f") for role in roles)])
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    out = ["", "CPU ms per request, by process (user + system, while the load ran):"]
    for line in table:
        cells = enumerate(zip(line, widths, strict=True))
        out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in cells))
    return out


def parse_levels(text: str) -> list[int] | None:
    """``--concurrencies``: the levels, each a run (None: the load's own concurrency)."""
    try:
        levels = [int(c) for c in text.split(",") if c.strip()] if text else None
    except ValueError:
        raise SystemExit(f"--concurrencies {text!r}: comma-separated numbers are needed") from None
    if levels is not None and (not levels or min(levels) < 1):
        raise SystemExit("--concurrencies: each at least 1")
    return levels


def main(args: argparse.Namespace) -> int:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if not modes or unknown:
        raise SystemExit(f"--modes: unknown {', '.join(unknown) or 'nothing'}; modes: {', '.join(sorted(MODES))}")
    spec = spec_from_args(args)
    levels = parse_levels(args.concurrencies)
    try:
        rows = compare(
            modes,
            spec,
            args.transport,
            args.api_key,
            levels,
            args.device,
            tuple(args.up_arg),
            args.hf_baseline,
            VARIANTS if args.compare_frontend_decode else (("", ()),),
        )
    except RuntimeError as exc:  # a stack that did not start: its log tail says why
        print(f"mmpipe bench --compare-modes: {exc}", file=sys.stderr, flush=True)
        return 1
    print(json.dumps(rows, indent=2) if args.json else format_rows(rows), flush=True)
    return 1 if any(row["summary"]["failed"] for row in rows) else 0
