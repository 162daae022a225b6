"""Tracing off by default (no provider set, steps still timed on the hop's
trace line), and the bench's first-token path over a trace whose times are
known."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from pipeline.bench.breakdown import SpanSink, first_token_path, format_summary, summarize
from pipeline.tracing import SpanRecord, TracingSettings, configure
from stages.contract import HopContext

MS = 1_000_000


def test_off_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    assert not TracingSettings().enabled
    assert configure(TracingSettings(), "mmpipe-test") is False
    assert not isinstance(trace.get_tracer_provider(), TracerProvider)  # no SDK: spans cost a call
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    assert TracingSettings().enabled and TracingSettings().endpoint == "http://collector:4318"
    with pytest.raises(ValueError, match="between 0 and 1"):
        TracingSettings(trace_sample=1.5)


def test_a_step_is_timed_with_tracing_off_even_when_it_fails() -> None:
    ctx = HopContext()
    with ctx.timed("prefill") as span:
        assert not span.is_recording()
    with pytest.raises(RuntimeError), ctx.timed("encode"):
        raise RuntimeError("boom")
    assert set(ctx.trace) == {"prefill_s", "encode_s"}
    assert all(v >= 0 for v in ctx.trace.values())


def _span(name: str, span_id: str, parent: str, start_ms: float, end_ms: float, hop: bool = False) -> SpanRecord:
    attributes: dict[str, str | int | float | bool] = {"worker": f"{name}-1"} if hop else {}
    return SpanRecord("t1", span_id, parent, name, "svc", int(start_ms * MS), int(end_ms * MS), attributes)


def _trace() -> list[SpanRecord]:
    return [
        _span("bridge", "b", "", 0, 20),
        _span("first_token", "f", "b", 1, 12),
        _span("processor", "p", "b", 2, 4, hop=True),
        _span("queue_wait", "pq", "p", 1.5, 2),
        _span("forward", "pf", "p", 3, 4),
        _span("encode+prefill+decode", "w", "pf", 5, 19, hop=True),
        _span("queue_wait", "wq", "w", 3.5, 5),
        _span("get", "wg", "w", 5, 7),
        _span("read", "wr", "wg", 5.5, 6.5),
        _span("prefill", "wp", "w", 7, 10),
        _span("first_reply", "wf", "w", 10, 11),
        _span("first_step", "ws", "w", 11, 13),  # after the first token: not on its path
    ]


def test_the_first_token_path_adds_up_to_the_bridges_ttft() -> None:
    path = first_token_path(_trace())
    assert path is not None
    ttft, steps = path
    assert ttft == 12.0
    got = [(s.label, round(s.ms, 3), s.nested) for s in steps]
    assert got == [
        ("bridge: HTTP in, request queued", 1.5, False),
        ("processor: queue wait", 0.5, False),
        ("processor: forward", 0.5, False),  # until the next hop's message was stored (3.5)
        ("processor: other", 1.0, False),
        ("processor: other › before forward", 1.0, True),  # where the other time lies
        ("encode+prefill+decode: queue wait", 1.5, False),
        ("encode+prefill+decode: get", 2.0, False),
        ("encode+prefill+decode: get › read", 1.0, True),
        ("encode+prefill+decode: prefill", 3.0, False),
        ("encode+prefill+decode: first_reply", 1.0, False),
        ("encode+prefill+decode: other", 0.0, False),
        ("reply: to the bridge", 1.0, False),
    ]
    assert sum(s.ms for s in steps if not s.nested) == pytest.approx(ttft)


def test_a_first_step_beside_the_first_reply_counts_only_until_the_reply_began() -> None:
    """The batch takes the sequence before its first token goes out: the
    first decode step's span begins before the first reply and runs on
    beside it. On the path it counts until the reply began; the reply
    counts whole, and the steps add up to the TTFT."""
    trace = [s for s in _trace() if s.name not in ("first_step", "first_reply")]
    trace += [_span("first_step", "ws", "w", 10, 13), _span("first_reply", "wf", "w", 10.2, 11)]
    path = first_token_path(trace)
    assert path is not None
    ttft, steps = path
    got = {s.label: round(s.ms, 3) for s in steps if s.label.startswith("encode+prefill+decode")}
    assert got["encode+prefill+decode: first_step"] == 0.2
    assert got["encode+prefill+decode: first_reply"] == 0.8
    assert got["encode+prefill+decode: other"] == 0.0
    assert round(sum(s.ms for s in steps if not s.nested), 3) == ttft


def test_a_hops_other_time_is_placed_between_its_steps() -> None:
    spans = [
        _span("bridge", "b", "", 0, 20),
        _span("first_token", "f", "b", 1, 12),
        _span("encode+prefill+decode", "w", "b", 2, 19, hop=True),
        _span("queue_wait", "wq", "w", 1.5, 2),
        _span("media_decode", "wm", "w", 2.02, 3),  # 0.02 ms after the hop began: too short to list
        _span("encode", "we", "w", 4, 5),
        _span("prefill", "wp", "w", 4.5, 8),  # overlaps the encode: no gap between them
        _span("first_reply", "wf", "w", 10, 11),
    ]
    path = first_token_path(spans)
    assert path is not None
    gaps = [(s.label, round(s.ms, 3)) for s in path[1] if "other ›" in s.label]
    assert gaps == [
        ("encode+prefill+decode: other › media_decode to encode", 1.0),
        ("encode+prefill+decode: other › prefill to first_reply", 2.0),
    ]
    # Labels longer than the table's first column widen it: every figure stays in its column.
    sink = SpanSink()
    sink.traces["t1"] = spans
    rows = format_summary(summarize(sink)).splitlines()[3:]
    assert len({len(row) for row in rows if not row.startswith("  sum")}) == 1
    other = next(s for s in path[1] if s.label == "encode+prefill+decode: other")
    # "other" is the hop less its steps' sum, which counts the overlap twice; the gaps are where nothing ran.
    assert other.ms == pytest.approx(9.0 - (0.98 + 1.0 + 3.5 + 1.0))


def test_the_summary_skips_traces_from_before_the_load_and_says_when_it_has_none() -> None:
    sink = SpanSink()
    assert "no complete traces" in format_summary(summarize(sink))
    sink.traces["t1"] = _trace()
    assert summarize(sink, since_ns=1)["requests"] == 0  # its bridge span started at 0
    summary = summarize(sink)
    assert summary["requests"] == 1 and summary["ttft_ms"] == 12.0
    text = format_summary(summary)
    assert "p50 12.00 ms" in text and "encode+prefill+decode: prefill" in text
