"""``mmpipe bench --engine-metrics URL``: where a worker's engine thread
spent the load, from its ``/metrics`` scraped before and after it.

The built-in engine times every call on its one thread by name (the wait
for the thread and the run) and the decode loop's interval between
hand-outs (stages/torch_engine/metrics.py); the difference of two scrapes
says, per call, how many ran, their mean wait and run, and the share of the
load's wall time they held the thread: a share near 100% in total is a
worker whose engine thread is the wall. Of each run, the time the thread
was on a CPU (the rest it waited: for the GPU, or for the GIL); and each
Python thread's CPU over the load, beside the process's: threads that
together hold about one core share one GIL and wait for each other.
"""

from __future__ import annotations

import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

WAIT, RUN = "mmpipe_engine_call_wait_seconds", "mmpipe_engine_call_seconds"
CPU = "mmpipe_engine_call_cpu_seconds_total"
GPU = "mmpipe_engine_call_gpu_seconds_total"
THREAD_CPU, PROCESS_CPU = "mmpipe_thread_cpu_seconds_total", "process_cpu_seconds_total"
# The same of an engine core process (--engine-process), as its worker shows them.
CORE_THREAD_CPU = "mmpipe_engine_core_thread_cpu_seconds_total"
CORE_PROCESS_CPU = "mmpipe_engine_core_process_cpu_seconds_total"
INTERVAL, ROWS = "mmpipe_decode_step_interval_seconds", "mmpipe_decode_batch_rows"
# The worker's own inter-token latency: between two chunks of a request, each once published.
PUBLISHED = "mmpipe_inter_token_latency_seconds"

# (sample name, its ``call`` or ``thread`` label, or a bucket's ``le``, or ""): value. Of the
# histograms' buckets only the step interval's are read.
Samples = dict[tuple[str, str], float]
# Step intervals longer than these (s) are counted apart: a running sequence's
# gaps between tokens in the worker, against an ITL goal.
LONG_STEPS = ("0.025", "0.05")


def parse(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{INTERVAL}_bucket":
                samples[(sample.name, sample.labels["le"])] = sample.value
            elif sample.name in (f"{PUBLISHED}_bucket", f"{PUBLISHED}_count"):
                # By where the gaps were taken (a worker's role, or the bridge).
                samples[(sample.name, f"{sample.labels['where']}|{sample.labels.get('le', '')}")] = sample.value
            elif not sample.name.endswith("_bucket"):
                samples[(sample.name, sample.labels.get("call") or sample.labels.get("thread", ""))] = sample.value
    return samples


def scrape(url: str, timeout_s: float = 5.0) -> Samples:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return parse(response.read().decode())


def summarize(before: Samples, after: Samples, wall_s: float) -> dict[str, Any]:
    """Per call: runs, mean wait, run and CPU (ms), share of ``wall_s``
    held; the decode loop's mean step interval (ms) and rows; the cores each
    Python thread and the whole process used over ``wall_s``."""
    wall_s = max(wall_s, 1e-9)
    delta = {key: value - before.get(key, 0.0) for key, value in after.items()}
    calls: dict[str, dict[str, float]] = {}
    for (name, call), value in delta.items():
        if call and name in (f"{WAIT}_sum", f"{RUN}_sum", f"{RUN}_count", CPU, GPU):
            calls.setdefault(call, {})[name] = value
    rows: list[dict[str, Any]] = []
    for call, v in calls.items():
        n = v.get(f"{RUN}_count", 0.0)
        if n <= 0:
            continue
        rows.append(
            {
                "call": call,
                "runs": int(n),
                "wait_ms": v.get(f"{WAIT}_sum", 0.0) / n * 1e3,
                "run_ms": v.get(f"{RUN}_sum", 0.0) / n * 1e3,
                "cpu_ms": v.get(CPU, 0.0) / n * 1e3,
                # None: not a CUDA engine.
                "gpu_ms": v[GPU] / n * 1e3 if GPU in v else None,
                "share": v.get(f"{RUN}_sum", 0.0) / wall_s,
            }
        )
    rows.sort(key=lambda r: -float(r["share"]))

    def mean(name: str) -> float | None:
        n = delta.get((f"{name}_count", ""), 0.0)
        return delta.get((f"{name}_sum", ""), 0.0) / n if n > 0 else None

    interval = mean(INTERVAL)

    def longer(name: str, where: str = "") -> dict[str, float]:
        at = f"{where}|" if where else ""
        n = delta.get((f"{name}_count", at), 0.0)
        return {le: 1 - delta.get((f"{name}_bucket", at + le), 0.0) / n for le in LONG_STEPS if n > 0}

    wheres = sorted({key.split("|")[0] for name, key in delta if name == f"{PUBLISHED}_count"})

    return {
        "calls": rows,
        "busy": sum(r["share"] for r in rows),
        "gpu_busy": sum(calls[r["call"]][GPU] for r in rows if GPU in calls[r["call"]]) / wall_s
        if any(GPU in v for v in calls.values())
        else None,
        "step_interval_ms": interval * 1e3 if interval is not None else None,
        "step_rows": mean(ROWS),
        # Of the step intervals, the fraction longer than each of LONG_STEPS (seconds, as text).
        "steps_longer": longer(INTERVAL),
        # The same of the gaps between a request's chunks as each role published them (the bridge: wrote them).
        "published_longer": {where: shares for where in wheres if (shares := longer(PUBLISHED, where))},
        "thread_cores": _thread_cores(THREAD_CPU, before, delta, wall_s),
        "process_cores": delta[(PROCESS_CPU, "")] / wall_s if (PROCESS_CPU, "") in delta else None,
        "core_thread_cores": _thread_cores(CORE_THREAD_CPU, before, delta, wall_s),
        "core_process_cores": delta[(CORE_PROCESS_CPU, "")] / wall_s if (CORE_PROCESS_CPU, "") in delta else None,
    }


def _thread_cores(family: str, before: Samples, delta: Samples, wall_s: float) -> dict[str, float]:
    """Threads alive at both scrapes; one that used under 1% of a core is left out."""
    return {
        thread: value / wall_s
        for (name, thread), value in sorted(delta.items(), key=lambda kv: -kv[1])
        if name == family and (name, thread) in before and value / wall_s >= 0.01
    }


def format_engine_calls(url: str, summary: dict[str, Any]) -> str:
    gpu = summary.get("gpu_busy")
    on_gpu = f"; its calls' work spanned {gpu:.0%} of it on the GPU" if gpu is not None else ""
    if not summary["calls"]:  # not a worker's engine (the bridge's /metrics, say)
        lines = [f"{url}:"]
    else:
        lines = [f"engine thread of {url}: busy {summary['busy']:.0%} of the load{on_gpu}"]
        lines.append(f"  {'call':<28}{'runs':>7}{'wait ms':>10}{'run ms':>9}{'on cpu ms':>11}{'gpu ms':>9}{'share':>8}")
    for r in summary["calls"]:
        gpu_ms = f"{r['gpu_ms']:>9.2f}" if r.get("gpu_ms") is not None else f"{'-':>9}"
        lines.append(
            f"  {r['call']:<28}{r['runs']:>7}{r['wait_ms']:>10.2f}{r['run_ms']:>9.2f}{r['cpu_ms']:>11.2f}{gpu_ms}"
            f"{r['share']:>8.1%}"
        )
    if summary["step_interval_ms"] is not None:
        lines.append(
            f"  decode loop: a step's tokens every {summary['step_interval_ms']:.2f} ms, {summary['step_rows']:.1f} "
            "rows on average"
        )
    longer = [("steps", summary.get("steps_longer") or {})]
    longer += [
        (f"a request's chunks as {'the bridge wrote' if where == 'bridge' else where + ' published'} them", shares)
        for where, shares in (summary.get("published_longer") or {}).items()
    ]
    for what, shares in longer:
        if shares:
            each = ", ".join(f"{float(le) * 1e3:g} ms: {share:.1%}" for le, share in shares.items())
            lines.append(f"  {what} further apart than {each}")
    for whose, threads_key, process_key in (
        ("its", "thread_cores", "process_cores"),
        ("its engine core's", "core_thread_cores", "core_process_cores"),
    ):
        threads = summary.get(threads_key) or {}
        if threads:
            process = summary.get(process_key)
            whole = f" (the process: {process:.2f})" if process is not None else ""
            each = ", ".join(f"{name} {cores:.2f}" for name, cores in threads.items())
            lines.append(f"  cores used by {whose} Python threads{whole}: {each}")
    if len(lines) == 1 and not summary["calls"]:
        # `mmpipe up --health-port P` gives P to its processor, which has no engine.
        lines[0] += " no engine calls or chunk timings here (a worker's /metrics has them; not a processor's)"
    return "\n".join(lines)
