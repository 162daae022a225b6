"""``mmpipe bench --breakdown``: where the time to the first token goes.

The stack runs with ``--trace-nats``: every process publishes its finished
spans on ``mmpipe.<ns>.spans.<process>``. The bench listens there while it
drives the load, then walks each request's trace along the path to its first
token: the bridge until the request is queued, and for each hop its queue
wait, its steps (media fetch and decode, encode, tensor get with its lease
and READ, prefill, tensor put, forwarding, the first reply) and what is left
of the hop outside them, up to the bridge receiving the first token.
"""

from __future__ import annotations

import asyncio
import statistics
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pipeline.tracing import SPAN_RECORDS, SpanRecord


@dataclass
class SpanSink:
    """Spans as they arrive, by trace."""

    traces: dict[str, list[SpanRecord]] = field(default_factory=lambda: defaultdict(list))

    def take(self, data: bytes) -> None:
        for record in SPAN_RECORDS.decode(data):
            self.traces[record.trace_id].append(record)


CONNECT_TIMEOUT_S = 5.0

T = TypeVar("T")


class NatsUnreachable(Exception):
    """No NATS server answered at the URL within ``CONNECT_TIMEOUT_S``."""


def with_stack_spans(args: Any, run: Callable[[str], Coroutine[Any, Any, T]]) -> T:
    """``run(nats_url)`` on the bench's loop with the stack's NATS URL
    (``--nats-url``, else the one the ``mmpipe up`` of ``--data-dir``
    recorded, else the default); a clear exit, not a hang, where no server
    answers there."""
    from pipeline.bench import run_async
    from pipeline.config import DEFAULT_NATS_URL
    from pipeline.discovery import nats_url_beside_up

    url, source = nats_url_beside_up(args.nats_url, Path(args.data_dir), default=DEFAULT_NATS_URL)
    try:
        return run_async(run(url))
    except NatsUnreachable:
        raise SystemExit(
            f"mmpipe bench --breakdown: no NATS server answered at {url} ({source}) within "
            f"{CONNECT_TIMEOUT_S:g} s: pass the stack's --nats-url (`mmpipe up` prints it) or its --data-dir"
        ) from None


@asynccontextmanager
async def spans_collected(nats_url: str, namespace: str) -> AsyncIterator[SpanSink]:
    """Every span the stack publishes while the block runs (the stack must
    run with --trace-nats on this NATS and namespace), and those of its last
    requests still on their way once it ends."""
    from pipeline.connection import connect, shutdown
    from pipeline.subjects import Subjects

    sink = SpanSink()
    try:
        nc, _ = await asyncio.wait_for(connect(nats_url, name="mmpipe-bench"), CONNECT_TIMEOUT_S)
    except TimeoutError:
        # connect() waits for a server for ever (a worker's wait): a bench
        # pointed at the wrong one would hang saying nothing.
        raise NatsUnreachable(nats_url) from None

    async def take(msg: Any) -> None:
        sink.take(msg.data)

    try:
        await nc.subscribe(Subjects(namespace).all_spans, cb=take)
        yield sink
        # The processes export spans in batches every 200 ms.
        await asyncio.sleep(1.0)
    finally:
        await shutdown(nc)


@dataclass(frozen=True)
class Step:
    label: str
    ms: float
    # Part of the step above it (a lease inside a get): not counted in the sum.
    nested: bool = False


def first_token_path(spans: Iterable[SpanRecord]) -> tuple[float, list[Step]] | None:
    """TTFT at the bridge (ms) and the steps that make it up, for one trace;
    None when the trace lacks its bridge or first-token span."""
    spans = list(spans)
    bridge = next(iter(_roots(spans)), None)
    first = next((s for s in spans if s.name == "first_token"), None)
    if bridge is None or first is None:
        return None
    end = first.end_ns
    children: dict[str, list[SpanRecord]] = defaultdict(list)
    for s in spans:
        children[s.parent_id].append(s)
    hops = sorted((s for s in spans if "worker" in s.attributes), key=lambda s: s.start_ns)
    steps: list[Step] = []

    def waited(hop: SpanRecord) -> SpanRecord | None:
        return next((c for c in children[hop.span_id] if c.name == "queue_wait"), None)

    def queued(hop: SpanRecord) -> int:
        """When the hop's message was stored: its queue wait's start."""
        wait = waited(hop)
        return wait.start_ns if wait is not None else hop.start_ns

    steps.append(Step("bridge: HTTP in, request queued", _ms((queued(hops[0]) if hops else end) - bridge.start_ns)))
    for i, hop in enumerate(hops):
        if hop.start_ns >= end:
            break
        role = hop.name
        wait = waited(hop)
        if wait is not None:
            steps.append(Step(f"{role}: queue wait", _ms(wait.end_ns - wait.start_ns)))
        # The hop that answers (the first with a reply the bridge had by the
        # first token; a hop that ends at prefill streams its token before it
        # forwards): until its first reply was stored. Any other: until the
        # next hop's message was stored, or the first token.
        replies = [c for c in children[hop.span_id] if c.name == "first_reply" and c.end_ns <= end]
        reply = min(replies, key=lambda c: c.end_ns) if replies else None
        nxt = hops[i + 1] if i + 1 < len(hops) and hops[i + 1].start_ns < end and reply is None else None
        until = reply.end_ns if reply is not None else min(end, queued(nxt)) if nxt is not None else end
        inside = 0.0
        timed = [
            (c, _path_end(c, reply, until))
            for c in sorted(children[hop.span_id], key=lambda s: s.start_ns)
            if c.name != "queue_wait" and c.start_ns < until
        ]
        for step, step_end in timed:
            ms = _ms(step_end - step.start_ns)
            inside += ms
            steps.append(Step(f"{role}: {step.name}", ms))
            for sub in sorted(children[step.span_id], key=lambda s: s.start_ns):
                if sub.start_ns < step_end:
                    steps.append(
                        Step(f"{role}: {step.name} › {sub.name}", _ms(min(sub.end_ns, step_end) - sub.start_ns), True)
                    )
        steps.append(Step(f"{role}: other", max(0.0, _ms(until - hop.start_ns) - inside)))
        steps += [Step(f"{role}: other › {where}", ms, True) for where, ms in _gaps(hop.start_ns, timed, until)]
        if nxt is None:
            if until < end:
                steps.append(Step("reply: to the bridge", _ms(end - until)))
            break
    return _ms(end - bridge.start_ns), steps


def _path_end(step: SpanRecord, reply: SpanRecord | None, until_ns: int) -> int:
    """Where a hop's step stops counting on the first token's path: at the
    path's end in the hop, or, for a step that began before the first reply
    and runs on beside it (the first decode step, which the batch takes
    before the first token goes out), where the reply began."""
    end = min(step.end_ns, until_ns)
    if reply is not None and step is not reply and step.start_ns <= reply.start_ns < end:
        return reply.start_ns
    return end


# Gaps shorter than this between a hop's steps are not listed on their own.
_GAP_MS = 0.05


def _gaps(start_ns: int, steps: list[tuple[SpanRecord, int]], until_ns: int) -> list[tuple[str, float]]:
    """Where a hop's "other" time lies: the stretches inside it that none of
    its steps cover (each step to where it stops counting), each named by
    the steps on either side (free to find: the spans are already there)."""
    out: list[tuple[str, float]] = []
    cursor, before = start_ns, ""
    for step, step_end in steps:
        if step.start_ns > cursor and _ms(step.start_ns - cursor) >= _GAP_MS:
            where = f"{before} to {step.name}" if before else f"before {step.name}"
            out.append((where, _ms(step.start_ns - cursor)))
        cursor, before = max(cursor, min(step_end, until_ns)), step.name
    if until_ns > cursor and _ms(until_ns - cursor) >= _GAP_MS:
        out.append((f"after {before}" if before else "no step", _ms(until_ns - cursor)))
    return out


def _roots(spans: list[SpanRecord]) -> list[SpanRecord]:
    """The trace's bridge span: its parent is none, or the client's (a
    traceparent the request came with), never one of the trace's own."""
    ids = {s.span_id for s in spans}
    return [s for s in spans if s.name == "bridge" and s.parent_id not in ids]


def _ms(ns: float) -> float:
    return ns / 1e6


def summarize(sink: SpanSink, since_ns: int = 0, within: Sequence[tuple[int, int]] | None = None) -> dict[str, Any]:
    """Medians over the traces that started after ``since_ns`` (and, given
    ``within``, inside one of its (start, end) windows of wall-clock ns),
    and the steps of the request at the median TTFT."""
    paths = []
    for spans in sink.traces.values():
        roots = _roots(spans)
        if not roots or roots[0].start_ns < since_ns:
            continue
        if within is not None and not any(start <= roots[0].start_ns <= end for start, end in within):
            continue
        path = first_token_path(spans)
        if path is not None:
            paths.append(path)
    if not paths:
        return {"requests": 0, "ttft_ms": None, "steps": [], "median_request": []}
    by_label: dict[str, list[float]] = defaultdict(list)
    order: list[str] = []
    nested: set[str] = set()
    for _, steps in paths:
        for step in steps:
            if step.label not in by_label:
                order.append(step.label)
            by_label[step.label].append(step.ms)
            if step.nested:
                nested.add(step.label)
    paths.sort(key=lambda p: p[0])
    ttft, median_steps = paths[len(paths) // 2]
    return {
        "requests": len(paths),
        "ttft_ms": statistics.median(p[0] for p in paths),
        "steps": [
            {
                "step": label,
                "p50_ms": statistics.median(by_label[label]),
                "n": len(by_label[label]),
                "nested": label in nested,
            }
            for label in order
        ],
        "median_request": {
            "ttft_ms": ttft,
            "steps": [{"step": s.label, "ms": s.ms, "nested": s.nested} for s in median_steps],
        },
    }


def format_summary(summary: dict[str, Any]) -> str:
    if not summary["requests"]:
        return "breakdown: no complete traces (is the stack running with --trace-nats on this NATS and namespace?)"
    median = summary["median_request"]
    at_median = {s["step"]: s["ms"] for s in median["steps"]}
    width = max([52] + [len(row["step"]) + 6 for row in summary["steps"]])
    lines = [
        f"time to first token, from {summary['requests']} traces: p50 {summary['ttft_ms']:.2f} ms "
        f"(the request at the median: {median['ttft_ms']:.2f} ms)",
        "",
        f"{'step':<{width}}{'p50 ms':>10}{'median request ms':>20}",
    ]
    total = 0.0
    for row in summary["steps"]:
        label = ("    " if row["nested"] else "  ") + row["step"]
        mine = at_median.get(row["step"])
        if mine is not None and not row["nested"]:
            total += mine
        lines.append(f"{label:<{width}}{row['p50_ms']:>10.2f}{'' if mine is None else f'{mine:.2f}':>20}")
    lines.append(f"{'  sum of the steps (not nested)':<{width}}{'':>10}{total:>20.2f}")
    return "\n".join(lines)
