"""``mmpipe bench``: the load generator against the in-process EPD stack, and
``mmpipe bench transport`` as a user runs it (two processes, real NIXL and
the NATS object store). ``--compare-modes`` starts four whole stacks one
after another: too slow for CI, run by hand (README, "Benchmarks")."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from pipeline.bench.engine_calls import format_engine_calls, scrape, summarize
from pipeline.bench.load import (
    LoadSpec,
    RequestResult,
    at_concurrency,
    client_processes,
    compared,
    format_report,
    percentile,
    report_engine_calls,
    run_load,
    scrape_engines,
    spec_from_args,
    split,
    steady_rate,
    synthetic_images,
)
from pipeline.bench.transport import format_rows, parse_size
from pipeline.cli import parser
from pipeline.nats_server import NatsServer, NatsServerConfig
from tests.e2e.conftest import Stack, start_stack

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


def test_the_busy_rate_leaves_out_the_first_wave_and_the_drain() -> None:
    def ended(*times: float, failed: tuple[float, ...] = ()) -> list[RequestResult]:
        return [RequestResult(ok=t not in failed, e2e_s=1.0, ended=t) for t in times]

    # Two clients: from the 2nd end (t=2) to the 6th (t=6), four requests in four seconds;
    # the slow last one (t=30, a client alone) is the drain that requests / wall would count.
    results = ended(1, 2, 3, 4, 5, 6, 7, 30)
    assert steady_rate(results, 2) == pytest.approx(1.0)
    assert steady_rate(ended(1, 2, 3, 4, 5, 6, 7, 30, failed=(4,)), 2) == pytest.approx(0.75)
    # Ends out of order (several client processes) are sorted; a request never run has no end.
    assert steady_rate([*reversed(results), RequestResult(ok=False, e2e_s=0.0)], 2) == pytest.approx(1.0)
    assert steady_rate(results, 4) is None  # eight requests, four clients: the first wave's end is the drain's start


def test_requests_per_client_give_every_level_the_same_rounds() -> None:
    args = parser().parse_args(["bench", "--concurrency", "4", "--requests-per-client", "6", "--requests", "10"])
    spec = spec_from_args(args)
    assert (spec.concurrency, spec.requests) == (4, 24)
    assert [(s.concurrency, s.requests) for s in (at_concurrency(spec, 64), at_concurrency(spec, 128))] == [
        (64, 384),
        (128, 768),
    ]
    plain = spec_from_args(parser().parse_args(["bench", "--concurrency", "4", "--requests", "10"]))
    assert at_concurrency(plain, 64).requests == 10
    with pytest.raises(SystemExit, match="must not be negative"):
        spec_from_args(parser().parse_args(["bench", "--requests-per-client", "-1"]))


def test_metrics_with_no_engine_say_so() -> None:
    # A processor's /metrics (mmpipe up's first health port): nothing of an engine's to show.
    text = format_engine_calls("http://p/metrics", summarize({}, {}, 1.0))
    assert text.startswith("http://p/metrics: no engine calls") and "not a processor's" in text


def test_a_load_shared_out_over_client_processes() -> None:
    spec = LoadSpec(concurrency=7, requests=23, seed=5)
    loads = split(spec, 3)
    assert [(s.concurrency, s.requests) for s in loads] == [(3, 10), (2, 7), (2, 6)]
    assert [s.seed for s in loads] == [5, 6, 7]  # images of their own, the first the single process's
    assert sum(s.concurrency for s in loads) == 7 and sum(s.requests for s in loads) == 23
    assert client_processes(LoadSpec(concurrency=64, processes=3)) == 3
    assert client_processes(LoadSpec(concurrency=2, requests=1, processes=3)) == 1
    assert client_processes(LoadSpec(concurrency=1)) == 1


def test_two_stacks_compared_pair_by_pair() -> None:
    def sent(*sides: tuple[bool, float | None]) -> list[RequestResult]:
        return [
            RequestResult(ok=ttft is not None, e2e_s=2 * (ttft or 1.0), ttft_s=ttft, compared=there)
            for there, ttft in sides
        ]

    a, b = False, True
    # Two client processes' results one after the other, the first's odd in
    # number: its last request has no pair, and the second's pairs stay whole.
    # A pair with a failed request gives no difference but counts on its side.
    results = sent((a, 0.010), (b, 0.013), (a, 0.020), (b, None), (a, 0.030), (a, 0.040), (b, 0.041))
    split = compared(results)
    assert (split["url"]["completed"], split["url"]["failed"]) == (4, 0)
    assert (split["compare_url"]["completed"], split["compare_url"]["failed"]) == (2, 1)
    assert split["ttft_diff_ms"]["n"] == 2
    assert split["ttft_diff_ms"]["mean"] == pytest.approx((3.0 + 1.0) / 2)
    assert split["e2e_diff_ms"]["mean"] == pytest.approx((6.0 + 2.0) / 2)
    assert split["url"]["ttft_ms"]["p50"] == pytest.approx(25.0)
    with pytest.raises(ValueError, match="one at a time"):
        LoadSpec(url="http://a/v1", compare_url="http://b/v1", trace_alternate=True)
    with pytest.raises(ValueError, match="url itself"):
        LoadSpec(url="http://a/v1", compare_url="http://a/v1/")
    with pytest.raises(SystemExit, match="runs alone"):
        from pipeline.bench import main

        main(parser().parse_args(["bench", "--compare-url", "http://b/v1", "--compare-modes"]))


@pytest.mark.e2e
async def test_one_load_over_two_stacks_sends_every_other_request_to_each(stack: Stack, tmp_path: Path) -> None:
    """--compare-url: a second stack (a NATS of its own, as two `mmpipe up`
    would have), half the requests and a warm-up each, each side's figures apart."""
    server = NatsServer(NatsServerConfig(data_dir=tmp_path / "nats-b", port=0))
    server.start()
    try:
        other, stop = await start_stack(replace(stack.config, nats_url=server.url), stack.spec)
    except BaseException:
        server.stop()
        raise
    try:
        before = [w.handled for w in stack.workers], [w.handled for w in other.workers]
        spec = LoadSpec(
            url=f"{stack.base_url}/v1",
            compare_url=f"{other.base_url}/v1",
            concurrency=2,
            requests=6,
            max_tokens=4,
            image_size=(64, 48),
        )
        summary = (await run_load(spec)).summary()
        handled = [w.handled for w in stack.workers], [w.handled for w in other.workers]
    finally:
        await stop()
        server.stop()
    assert summary["errors"] == {} and summary["warmup_error"] is None and summary["completed"] == 6
    # Each stack's one EPD worker (after the processor) ran its warm-up and three.
    assert [after[-1] - was[-1] for after, was in zip(handled, before, strict=True)] == [4, 4]
    split = summary["compared"]
    assert split["url"]["completed"] == split["compare_url"]["completed"] == 3
    assert split["ttft_diff_ms"]["n"] == 3 and split["url"]["ttft_ms"]["p50"] > 0
    text = format_report(summary)
    assert f"B: {other.base_url}/v1 (3 completed, 0 failed)" in text and "TTFT ms, B − A" in text


@pytest.mark.e2e
@pytest.mark.parametrize(("processes", "client"), [(1, "openai"), (2, "openai"), (1, "aiohttp")])
async def test_load_generator_against_the_epd_stack(stack: Stack, processes: int, client: str) -> None:
    spec = LoadSpec(
        url=f"{stack.base_url}/v1",
        concurrency=2,
        requests=6,
        max_tokens=8,
        image_size=(96, 64),
        processes=processes,
        client=client,
    )
    report = await run_load(spec)
    summary = report.summary()
    assert summary["errors"] == {} and summary["warmup_error"] is None
    assert (summary["completed"], summary["failed"], summary["short"]) == (6, 0, 0)
    assert [r.tokens for r in report.results] == [8] * 6
    assert [len(r.itl_s) for r in report.results] == [7] * 6  # one chunk per token
    # The gaps apart: each request's first (prefill's token to the decode loop's first), then the rest.
    assert (summary["itl_first_ms"]["n"], summary["itl_later_ms"]["n"]) == (6, 36)
    firsts = [r.itl_s[0] for r in report.results]
    assert summary["itl_first_ms"]["mean"] == pytest.approx(1000 * sum(firsts) / len(firsts))
    assert summary["completion_tokens"] == 48
    assert summary["prompt_tokens_mean"] > 0
    if processes == 1:
        # A long-context load: each filler word one more prompt token (and the document's number a few).
        longer = (await run_load(replace(spec, requests=2, concurrency=1, filler_words=50))).summary()
        assert 50 < longer["prompt_tokens_mean"] - summary["prompt_tokens_mean"] <= 60
        # Distinct documents: the second shares its image's and the chat template's blocks with the first, not the text.
        assert longer["cached_tokens_mean"] < longer["prompt_tokens_mean"] - 50
        # The same seed again: its prompts, images and all, are in the prefix cache, and the report says so.
        again = (await run_load(replace(spec, trace_alternate=True))).summary()
        assert again["cached_tokens_mean"] > summary["cached_tokens_mean"]
        assert f"({again['cached_tokens_mean']:.0f} of them cached)" in format_report(again)
        # Every other request asked to be traced: TTFT for each half.
        assert (again["ttft_traced_ms"]["n"], again["ttft_untraced_ms"]["n"]) == (3, 3)
        assert "TTFT ms, not traced" in format_report(again) and "ttft_traced_ms" not in summary
    for key in ("ttft_ms", "itl_ms", "e2e_ms"):
        s = summary[key]
        assert 0 < s["p50"] <= s["p90"] <= s["p99"], (key, s)
    assert summary["ttft_ms"]["p99"] < summary["e2e_ms"]["p99"]
    assert summary["requests_per_s"] > 0 and summary["tokens_per_s"] > 0
    assert summary["steady_requests_per_s"] > 0 and "with every client busy" in format_report(summary)
    assert len(summary["client_cpu"]) == processes and all(0 < c for c in summary["client_cpu"])
    assert "TTFT ms" in format_report(summary) and f"client: {processes} process" in format_report(summary)
    assert f"client={client}" in format_report(summary)
    if client == "aiohttp":
        # An answer other than a stream (no such model: 404) is the request's error, as with the openai client.
        bad = (await run_load(replace(spec, model="no-such-model", requests=1, concurrency=1))).summary()
        assert bad["failed"] == 1 and any("404" in e for e in bad["errors"]), bad["errors"]


@pytest.mark.e2e
async def test_engine_metrics_say_where_the_workers_engine_thread_went(stack: Stack) -> None:
    """--engine-metrics: the worker's /metrics (here the in-process stack's
    registry served over HTTP) scraped around a load: each engine call the
    load made, counted (the warm-up request's too), and the decode loop's pace."""
    import asyncio

    from prometheus_client import start_http_server

    server, thread = start_http_server(0, addr="127.0.0.1")
    url = f"http://127.0.0.1:{server.server_port}/metrics"
    try:
        before = await asyncio.to_thread(scrape, url)
        spec = LoadSpec(url=f"{stack.base_url}/v1", concurrency=2, requests=5, max_tokens=6, image_size=(64, 48))
        report = await run_load(spec)
        after = await asyncio.to_thread(scrape, url)
        # The same through `mmpipe bench --engine-metrics URL`'s flag and its report.
        args = parser().parse_args(["bench", "--engine-metrics", url])
        report_summary = report.summary()
        printed = report_engine_calls(args, await asyncio.to_thread(scrape_engines, args), report_summary)
        # (Scraped after the load, around nothing: no engine call, so no engine thread's table.)
        assert printed.startswith(f"\n\n{url}:") and url in report_summary["engine_calls"]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    summary = summarize(before, after, report.wall_s)
    runs = {row["call"]: row["runs"] for row in summary["calls"]}
    assert runs["_encode_together"] == runs["prefill_one"] == 6  # 5 and the warm-up
    # A finished sequence's release rides the decode loop's next call, or is
    # one of its own when the loop has none to make.
    assert runs.get("release", 0) <= 6
    assert runs["launch_then_collect"] >= 5  # tokens after the first come from the decode loop
    assert summary["busy"] > 0 and all(row["run_ms"] > 0 for row in summary["calls"])
    # A thread's CPU time over a call is at most the call's wall time (both
    # clocks read at its start and end, the CPU's a microsecond later).
    assert all(0 < row["cpu_ms"] <= row["run_ms"] + 0.01 for row in summary["calls"] if row["call"] == "prefill_one")
    assert summary["step_interval_ms"] > 0 and 1 <= summary["step_rows"] <= 2
    longer = summary["steps_longer"]
    assert set(longer) == {"0.025", "0.05"} and 0 <= longer["0.05"] <= longer["0.025"] <= 1
    # The gaps between a request's chunks, as the worker published them and as the bridge wrote them.
    assert set(summary["published_longer"]) == {"bridge", "encode+prefill+decode"}
    # This process's event loop served the stack; the whole process used at
    # least what it did (the process's counter moves in 10 ms ticks).
    assert summary["thread_cores"]["MainThread"] > 0
    assert summary["process_cores"] + 0.02 / report.wall_s >= summary["thread_cores"]["MainThread"]
    text = format_engine_calls(url, summary)
    assert "prefill_one" in text and "decode loop" in text and "MainThread" in text


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


@pytest.mark.e2e
def test_bench_transport_shows_the_nixl_read_alone() -> None:
    cmd = [sys.executable, "-m", "pipeline.cli", "bench", "transport", "--sizes", "4MB", "--repeats", "3"]
    done = subprocess.run(
        [*cmd, "--transports", "nixl", "--json"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads(done.stdout)
    assert row["device"] == "cpu"
    # The READ is part of the get: it cannot take longer than the whole get.
    assert 0 < row["read_p50_ms"] <= row["get_p50_ms"]
    assert row["read_ratio"] == pytest.approx(row["read_gbps_p50"] / row["memcpy_gbps"])
    assert "READ ratio" in format_rows([row])
    # get_into a tensor the reader holds: the same bytes, checksummed, with its own ratio.
    assert row["into_p50_ms"] > 0 and row["into_ratio"] > 0
    assert "into ratio" in format_rows([row])


def test_one_set_of_generate_times_makes_each_concurrencys_closed_loop() -> None:
    """The baseline's requests are served once; each concurrency's waiting is
    made from those times: one client never waits, four queue behind each
    other, and the server's busy time (the run) is the same."""
    from pipeline.bench.hf_baseline import closed_loop

    services = [(0.1, [0.05] * 4, 1.0), (0.2, [0.05] * 4, 2.0), (0.1, [0.05] * 4, 1.0)]
    alone = closed_loop(services, LoadSpec(concurrency=1, requests=3))
    crowd = closed_loop(services, LoadSpec(concurrency=4, requests=3))
    assert [r.ttft_s for r in alone.results] == pytest.approx([0.1, 0.2, 0.1])
    assert [r.ttft_s for r in crowd.results] == pytest.approx([0.1, 1.2, 3.1])
    assert [r.e2e_s for r in crowd.results] == pytest.approx([1.0, 3.0, 4.0])
    assert alone.wall_s == crowd.wall_s == pytest.approx(4.0)
    assert crowd.summary()["config"]["concurrency"] == 4


def test_plain_transformers_baseline_queues_one_request_at_a_time(tiny_model_dir: Path) -> None:
    from pipeline.bench.hf_baseline import HfServer, run_hf_load
    from pipeline.bench.modes import HF, ratios
    from pipeline.bench.modes import format_rows as format_modes

    spec = LoadSpec(model=str(tiny_model_dir), concurrency=3, requests=4, max_tokens=5, image_size=(56, 56))
    server = HfServer(tiny_model_dir, "cpu")
    report = run_hf_load(server, spec, synthetic_images(spec))
    assert [(r.ok, r.tokens, len(r.itl_s)) for r in report.results] == [(True, 5, 4)] * 4
    first, second = report.results[0], report.results[1]
    # The second client sent at 0 too, and waited for the whole first request.
    assert second.ttft_s is not None and second.ttft_s > first.e2e_s
    # Always a request queued: the server never idles, the last one ends the run.
    assert report.wall_s >= max(r.e2e_s for r in report.results)
    summary = report.summary()
    row = {"mode": HF, "concurrency": 3, "transport": "-", "summary": summary, "baseline": HF}
    row["ratios"] = ratios(summary, summary)
    assert row["ratios"]["ttft_ms.p50"] == pytest.approx(1.0)
    table = format_modes([row])
    assert "transformers" in table and "TTFT p99 ms" in table


def test_bench_encode_batches_requests_into_one_call(tiny_model_dir: Path) -> None:
    import argparse

    from pipeline.bench.encode import add_arguments, format_result, run

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--model", str(tiny_model_dir), "--images", "3", "--image-size", "56x56", "--repeats", "1"])
    result = run(args)
    assert result["device"] == "cpu" and result["images"] == 3 and result["tokens_per_image"] == 4
    assert result["mmpipe_calls_per_batch"] == 1.0  # three requests, one tower call
    assert result["mmpipe_one_ms"] > 0 and result["mmpipe_batch_ms"] > 0 and result["hf_batch_ms"] > 0
    assert "per-image" in format_result(result)


@pytest.mark.e2e
async def test_the_multiturn_workload_reports_each_turns_prefix_hits(stack: Stack) -> None:
    from pipeline.bench.multiturn import format_summary
    from pipeline.bench.multiturn import run as run_multiturn

    spec = LoadSpec(url=f"{stack.base_url}/v1", max_tokens=4, image_size=(64, 48), filler_words=120)
    summary = await run_multiturn(spec, users=2, turns=3)
    assert (summary["completed"], summary["failed"], summary["warmup_error"]) == (6, 0, None)
    first, second, third = summary["per_turn"]
    # Each turn resends the conversation so far: longer prompts, and the earlier turns' blocks found.
    assert first["prompt_tokens_mean"] < second["prompt_tokens_mean"] < third["prompt_tokens_mean"]
    assert first["cached_tokens_mean"] == 0
    assert second["cached_tokens_mean"] >= 120 and third["cached_tokens_mean"] >= second["cached_tokens_mean"]
    assert 0.5 < summary["hit_rate_after_first"] <= 1
    assert "hit rate" in format_summary(summary)
