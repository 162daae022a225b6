"""``mmpipe bench --engine-metrics``'s arithmetic on two scrapes of a
worker's ``/metrics`` (pipeline/bench/engine_calls.py): the decode loop's
long step intervals, from its histogram's buckets."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from pipeline.bench.engine_calls import format_engine_calls, parse, summarize


def test_the_share_of_steps_further_apart_than_25_and_50_ms_comes_from_the_interval_buckets() -> None:
    registry = CollectorRegistry()
    buckets = (0.001, 0.01, 0.025, 0.05, 0.1)
    intervals = Histogram("mmpipe_decode_step_interval_seconds", "", buckets=buckets, registry=registry)
    rows = Histogram("mmpipe_decode_batch_rows", "", registry=registry)
    for seconds in (0.002, 0.03, 0.2):  # before the load: not counted
        intervals.observe(seconds)
    before = parse(generate_latest(registry).decode())
    for seconds in [0.005] * 16 + [0.03] * 3 + [0.07]:
        intervals.observe(seconds)
        rows.observe(8)
    after = parse(generate_latest(registry).decode())
    summary = summarize(before, after, wall_s=1.0)
    assert summary["steps_longer"] == {"0.025": pytest.approx(4 / 20), "0.05": pytest.approx(1 / 20)}
    assert "steps further apart than 25 ms: 20.0%, 50 ms: 5.0%" in format_engine_calls("url", summary)


def test_without_steps_in_the_load_no_share_is_made_up() -> None:
    registry = CollectorRegistry()
    Histogram("mmpipe_decode_step_interval_seconds", "", buckets=(0.025, 0.05), registry=registry)
    text = parse(generate_latest(registry).decode())
    summary = summarize(text, text, wall_s=1.0)
    assert summary["steps_longer"] == {} and "further apart" not in format_engine_calls("url", summary)


def test_the_gaps_between_a_requests_chunks_are_counted_where_each_was_taken() -> None:
    """A worker's role as it published them, the bridge as it wrote them:
    apart, so a burst is placed between the two."""
    registry = CollectorRegistry()
    itl = Histogram(
        "mmpipe_inter_token_latency_seconds", "", ["where"], buckets=(0.01, 0.025, 0.05, 0.1), registry=registry
    )
    before = parse(generate_latest(registry).decode())
    for seconds in (0.005, 0.005, 0.03, 0.06):
        itl.labels("encode+prefill+decode").observe(seconds)
    for seconds in (0.005, 0.2, 0.005, 0.005, 0.005):
        itl.labels("bridge").observe(seconds)
    summary = summarize(before, parse(generate_latest(registry).decode()), wall_s=1.0)
    assert summary["published_longer"] == {
        "bridge": {"0.025": pytest.approx(1 / 5), "0.05": pytest.approx(1 / 5)},
        "encode+prefill+decode": {"0.025": pytest.approx(2 / 4), "0.05": pytest.approx(1 / 4)},
    }
    text = format_engine_calls("u", summary)
    assert text.startswith("u:")  # no engine calls here: no engine thread's table
    assert "chunks as encode+prefill+decode published them further apart than 25 ms: 50.0%, 50 ms: 25.0%" in text
    assert "chunks as the bridge wrote them further apart than 25 ms: 20.0%, 50 ms: 20.0%" in text
