"""``mmpipe bench``: the load generator against the in-process EPD stack, and
``mmpipe bench transport`` as a user runs it (two processes, real NIXL and
the NATS object store). ``--compare-modes`` starts four whole stacks one
after another: too slow for CI, run by hand (README, "Benchmarks")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.bench.load import LoadSpec, format_report, percentile, run_load, synthetic_images
from pipeline.bench.transport import format_rows, parse_size
from tests.e2e.conftest import Stack

REPO = Path(__file__).resolve().parents[2]


def test_helpers() -> None:
    spec = LoadSpec(requests=5, images_per_request=2, image_size=(16, 8), seed=3)
    warmup, sets = synthetic_images(spec)
    urls = warmup + [url for s in sets for url in s]
    assert len(sets) == 5 and len(urls) == 12 == len(set(urls))  # no two alike: the embedding cache never hits
    assert synthetic_images(spec) == (warmup, sets)  # seeded
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 90) == pytest.approx(9.0)
    assert percentile([5.0], 99) == 5.0
    assert parse_size("2MB") == 2_000_000 and parse_size("1MiB") == 1 << 20 and parse_size("512") == 512
    with pytest.raises(ValueError):
        parse_size("2 parsecs")


@pytest.mark.e2e
async def test_load_generator_against_the_epd_stack(stack: Stack) -> None:
    spec = LoadSpec(url=f"{stack.base_url}/v1", concurrency=2, requests=6, max_tokens=8, image_size=(96, 64))
    report = await run_load(spec)
    summary = report.summary()
    assert summary["errors"] == {} and summary["warmup_error"] is None
    assert (summary["completed"], summary["failed"], summary["short"]) == (6, 0, 0)
    assert [r.tokens for r in report.results] == [8] * 6
    assert [len(r.itl_s) for r in report.results] == [7] * 6  # one chunk per token
    assert summary["completion_tokens"] == 48
    for key in ("ttft_ms", "itl_ms", "e2e_ms"):
        s = summary[key]
        assert 0 < s["p50"] <= s["p90"] <= s["p99"], (key, s)
    assert summary["ttft_ms"]["p99"] < summary["e2e_ms"]["p99"]
    assert summary["requests_per_s"] > 0 and summary["tokens_per_s"] > 0
    assert "TTFT ms" in format_report(summary)


@pytest.mark.e2e
def test_bench_transport_command_reports_both_transports() -> None:
    cmd = [sys.executable, "-m", "pipeline.cli", "bench", "transport", "--sizes", "1MB", "--repeats", "3", "--json"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout)
    assert [(r["transport"], r["bytes"], r["repeats"]) for r in rows] == [("nixl", 10**6, 3), ("nats", 10**6, 3)]
    for r in rows:
        assert r["gbps_p50"] > 0 and r["gbps_best"] >= r["gbps_p50"] and r["memcpy_gbps"] > 0
        assert r["ratio"] == pytest.approx(r["gbps_p50"] / r["memcpy_gbps"])
    table = format_rows(rows)
    assert "nixl" in table and "nats" in table and "ratio" in table
