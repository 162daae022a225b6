"""One trace a request, across processes: ``mmpipe up --trace-nats`` in
E/P/D, an image request from the official client, and the spans every
process published on NATS. The bridge's span is the root; each hop
continues the trace it found in its message's headers; the steps of a hop
(media, encode, the tensor hand-offs with their lease and READ, prefill)
sit under that hop; and the first-token path the bench prints adds up.
With --otlp-endpoint the same spans reach a collector over OTLP/HTTP."""

from __future__ import annotations

import asyncio
import re
import signal
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from pipeline.bench.breakdown import SpanSink, first_token_path
from pipeline.connection import connect, shutdown
from pipeline.subjects import Subjects
from pipeline.tracing import SpanRecord
from tests.e2e.conftest import gradient, png_data_url
from tests.e2e.processes import Processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _by_name(spans: list[SpanRecord], name: str) -> list[SpanRecord]:
    """Steps of that name (not a hop's span, which is named after its role)."""
    return [s for s in spans if s.name == name and "worker" not in s.attributes]


def _only(spans: list[SpanRecord], name: str) -> SpanRecord:
    found = _by_name(spans, name)
    assert len(found) == 1, (name, [s.name for s in spans])
    return found[0]


@pytest.mark.e2e
async def test_one_request_is_one_trace_across_every_process(
    tmp_path: Path, mmpipe_home: Path, tiny_model_dir: Path
) -> None:
    procs = Processes(tmp_path, mmpipe_home)
    port, nats_port = _free_port(), _free_port()
    up = procs.start(
        "up", "--mode", "e-p-d", "--port", str(port), "--nats-port", str(nats_port), "--trace-nats",
        "--data-dir", str(tmp_path / "data"), "--model", str(tiny_model_dir), "--transport", "nixl",
    )  # fmt: skip
    try:
        spans = await _trace_of_one_request(
            up, port, {"bridge", "first_token", "encode", "prefill", "decode", "first_step"}
        )
    finally:
        code = up.stop(signal.SIGINT)
        procs.stop_all()
    assert code == 0, up.text()[-3000:]

    ids = {s.span_id: s for s in spans}
    bridge = _only(spans, "bridge")  # the bridge is no worker: its span is found too
    assert bridge.parent_id == "" and bridge.service == "mmpipe-bridge"
    # Hop after hop, each the child of the one that forwarded its message (of its forward step).
    hops = sorted((s for s in spans if "worker" in s.attributes), key=lambda s: s.start_ns)
    # mmpipe up's bridge processes the request itself: its first hop is the encode worker's.
    assert [h.name for h in hops] == ["encode", "prefill", "decode"]
    parents = [bridge, *hops[:-1]]
    for hop, parent in zip(hops, parents, strict=True):
        forwarded_by = ids[hop.parent_id]
        if forwarded_by.name == "forward":
            forwarded_by = ids[forwarded_by.parent_id]
        assert forwarded_by == parent, hop.name
        assert hop.service == f"mmpipe-{hop.name}"
        assert hop.attributes["request_id"] == bridge.attributes["request_id"]
        wait = next(s for s in spans if s.name == "queue_wait" and s.parent_id == hop.span_id)
        assert wait.start_ns <= wait.end_ns <= hop.start_ns + 5_000_000  # clocks of one host
    # Each step under the hop that ran it.
    under = {name: {ids[s.parent_id].name for s in _by_name(spans, name)} for name in ("media_fetch", "encode")}
    assert under == {"media_fetch": {"encode"}, "encode": {"encode"}}
    assert {ids[s.parent_id].name for s in _by_name(spans, "prefill")} == {"prefill"}
    assert {ids[s.parent_id].name for s in _by_name(spans, "put")} == {"encode", "prefill"}
    gets = {ids[s.parent_id].name: s for s in _by_name(spans, "get")}
    assert sorted(gets) == ["decode", "prefill"]
    for get in gets.values():
        # The NIXL hand-off: a lease and a READ, inside the get.
        inside = {s.name for s in spans if s.parent_id == get.span_id}
        assert {"lease", "read"} <= inside, inside
    assert _only(spans, "first_step").parent_id == hops[-1].span_id

    # The bench's first-token path covers the bridge's TTFT, step by step.
    path = first_token_path(spans)
    assert path is not None
    ttft_ms, steps = path
    labels = [s.label for s in steps]
    for label in ("encode: queue wait", "encode: encode", "prefill: get › read", "prefill: prefill"):
        assert label in labels, labels
    # The prefill hop streams the first token itself: the KV hand-off and the
    # decode hop are off the first token's path.
    assert "prefill: first_reply" in labels and not [label for label in labels if label.startswith("decode")], labels
    total = sum(s.ms for s in steps if not s.nested)
    assert total == pytest.approx(ttft_ms, rel=0.02), steps
    assert all(s.ms >= 0 for s in steps)


@pytest.mark.e2e
async def test_a_clients_traceparent_is_continued_and_its_sampling_kept(
    tmp_path: Path, mmpipe_home: Path, tiny_model_dir: Path
) -> None:
    procs = Processes(tmp_path, mmpipe_home)
    port = _free_port()
    up = procs.start(
        "up", "--port", str(port), "--trace-nats", "--data-dir", str(tmp_path / "data"),
        "--model", str(tiny_model_dir),
    )  # fmt: skip
    traced, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    untraced = "0af7651916cd43dd8448eb211c80319c"
    try:
        # Asked not to be recorded first: its spans, were they recorded, would
        # be exported no later than those of the request after it.
        sink = await _spans_while(
            up,
            port,
            [f"00-{untraced}-b7ad6b7169203331-00", f"00-{traced}-{client_span}-01"],
            lambda sink: {"bridge", "first_token", "prefill"} <= {s.name for s in sink.traces.get(traced, [])},
        )
    finally:
        code = up.stop(signal.SIGINT)
        procs.stop_all()
    assert code == 0, up.text()[-3000:]
    assert untraced not in sink.traces, sorted({s.name for s in sink.traces[untraced]})
    spans = sink.traces[traced]
    bridge = _only(spans, "bridge")
    assert bridge.parent_id == client_span and bridge.service == "mmpipe-bridge"
    path = first_token_path(spans)  # the bench still finds the request's path
    assert path is not None and path[0] > 0


async def _spans_while(up: Any, port: int, traceparents: list[str], done: Any) -> SpanSink:
    """Spans published while one text request per traceparent is answered,
    one after another, until ``done(sink)``."""

    async def send(c: openai.AsyncOpenAI) -> None:
        for parent in traceparents:
            await c.chat.completions.create(
                model="tiny-qwen2-vl",
                messages=[{"role": "user", "content": "What?"}],
                max_tokens=2,
                temperature=0,
                extra_headers={"traceparent": parent},
            )

    return await _collect_spans(up, port, send, done)


async def _trace_of_one_request(up: Any, port: int, names: set[str]) -> list[SpanRecord]:
    """The spans of one image request sent to a ready ``mmpipe up
    --trace-nats``, once a trace holds every one of ``names`` and the
    worker's hop."""

    async def send(c: openai.AsyncOpenAI) -> None:
        content: Any = [
            {"type": "image_url", "image_url": {"url": png_data_url(gradient(64, 48, 1))}},
            {"type": "text", "text": "What?"},
        ]
        chunks = await c.chat.completions.create(
            model="tiny-qwen2-vl",
            messages=[{"role": "user", "content": content}],
            max_tokens=4,
            temperature=0,
            stream=True,
        )
        async for _ in chunks:
            pass

    def whole(sink: SpanSink) -> list[SpanRecord] | None:
        # The worker's hop span too: it ends last, and may come in a later export batch than its steps.
        return next(
            (
                spans
                for spans in sink.traces.values()
                if names <= {s.name for s in spans} and any("worker" in s.attributes for s in spans)
            ),
            None,
        )

    sink = await _collect_spans(up, port, send, whole)
    spans = whole(sink)
    assert spans is not None
    return spans


async def _collect_spans(
    up: Any, port: int, send: Callable[[openai.AsyncOpenAI], Awaitable[None]], done: Callable[[SpanSink], Any]
) -> SpanSink:
    """The spans a ready ``mmpipe up --trace-nats`` publishes while ``send``
    runs its requests, until ``done(sink)``."""
    up.wait_for("mmpipe ready")
    url = re.search(r"nats=(\S+)", up.text())
    assert url
    sink = SpanSink()
    nc, _ = await connect(url.group(1), name="test-spans")
    try:

        async def take(msg: Any) -> None:
            sink.take(msg.data)

        await nc.subscribe(Subjects("default").all_spans, cb=take)
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0) as c:
            await send(c)
        for _ in range(100):  # the processes export in batches every 200 ms
            if done(sink):
                return sink
            await asyncio.sleep(0.1)
        raise AssertionError({t: sorted({s.name for s in v}) for t, v in sink.traces.items()})
    finally:
        await shutdown(nc)


@pytest.mark.e2e
async def test_an_engine_processs_steps_are_spans_of_the_workers_hop(
    tmp_path: Path, mmpipe_home: Path, tiny_model_dir: Path
) -> None:
    procs = Processes(tmp_path, mmpipe_home)
    port, nats_port = _free_port(), _free_port()
    up = procs.start(
        "up", "--port", str(port), "--nats-port", str(nats_port), "--trace-nats", "--engine-process",
        "--data-dir", str(tmp_path / "data"), "--model", str(tiny_model_dir),
    )  # fmt: skip
    try:
        spans = await _trace_of_one_request(
            up, port, {"bridge", "engine_encode", "media_fetch", "encode", "engine_prefill", "prefill", "first_step"}
        )
    finally:
        code = up.stop(signal.SIGINT)
        procs.stop_all()
    assert code == 0, up.text()[-3000:]
    ids = {s.span_id: s for s in spans}
    (hop,) = [s for s in spans if "worker" in s.attributes]
    # The core's steps, timed there, under the worker's call that asked for them, inside it in time.
    for step, call in (("media_fetch", "engine_encode"), ("encode", "engine_encode"), ("prefill", "engine_prefill")):
        span = _only(spans, step)
        parent = ids[span.parent_id]
        assert parent.name == call and ids[parent.parent_id] == hop, (step, parent.name)
        assert parent.start_ns <= span.start_ns <= span.end_ns <= parent.end_ns, step
        assert span.service == hop.service
    assert _only(spans, "first_step").parent_id == hop.span_id
    path = first_token_path(spans)
    assert path is not None
    labels = [s.label for s in path[1]]
    assert any(label.endswith("encode") for label in labels) and any("prefill" in label for label in labels), labels


@pytest.mark.e2e
async def test_spans_go_to_an_otlp_collector(tmp_path: Path, mmpipe_home: Path, tiny_model_dir: Path) -> None:
    # A collector's OTLP/HTTP endpoint, as an OpenTelemetry Collector or Jaeger serves it.
    received: list[Any] = []

    async def traces(request: web.Request) -> web.Response:
        body = ExportTraceServiceRequest()
        body.ParseFromString(await request.read())
        for resource in body.resource_spans:
            service = next(a.value.string_value for a in resource.resource.attributes if a.key == "service.name")
            for scope in resource.scope_spans:
                received.extend((service, span.name, span.trace_id.hex()) for span in scope.spans)
        return web.Response(content_type="application/x-protobuf", body=b"")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app)
    await runner.setup()
    collector_port, port = _free_port(), _free_port()
    await web.TCPSite(runner, "127.0.0.1", collector_port).start()
    procs = Processes(tmp_path, mmpipe_home)
    up = procs.start(
        "up", "--port", str(port), "--otlp-endpoint", f"http://127.0.0.1:{collector_port}",
        "--data-dir", str(tmp_path / "data"), "--model", str(tiny_model_dir),
    )  # fmt: skip
    try:
        up.wait_for("mmpipe ready")
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0) as c:
            reply = await c.chat.completions.create(
                model="tiny-qwen2-vl", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0
            )
            assert reply.choices[0].message.content
        # The batch exporter sends every 5 s, and what is left when a process stops.
        wanted = {("mmpipe-bridge", "bridge"), ("mmpipe-encode+prefill+decode", "prefill")}
        for _ in range(200):
            if wanted <= {(service, name) for service, name, _ in received}:
                break
            await asyncio.sleep(0.1)
    finally:
        code = up.stop(signal.SIGINT)
        procs.stop_all()
        await runner.cleanup()
    assert code == 0, up.text()[-3000:]
    assert wanted <= {(service, name) for service, name, _ in received}, received
    # The bridge's request and the worker's prefill are one trace.
    bridge_traces = {t for service, name, t in received if name == "bridge"}
    assert {t for _, name, t in received if name == "prefill"} <= bridge_traces


@pytest.mark.e2e
async def test_the_multiturn_bench_tells_the_first_turns_time_from_the_later_turns(
    tmp_path: Path, mmpipe_home: Path, tiny_model_dir: Path
) -> None:
    """``mmpipe bench --workload multiturn --breakdown``: each turn's trace
    counted with its own kind of turn. A later turn's prefix holds the
    image, so its hop encodes nothing, where every first turn's does."""
    from pipeline.bench.load import LoadSpec
    from pipeline.bench.multiturn import format_summary, run_traced

    procs = Processes(tmp_path, mmpipe_home)
    port, nats_port = _free_port(), _free_port()
    up = procs.start(
        "up", "--port", str(port), "--nats-port", str(nats_port), "--trace-nats",
        "--data-dir", str(tmp_path / "data"), "--model", str(tiny_model_dir),
    )  # fmt: skip
    try:
        up.wait_for("mmpipe ready")
        url = re.search(r"nats=(\S+)", up.text())
        assert url
        spec = LoadSpec(
            url=f"http://127.0.0.1:{port}/v1", max_tokens=2, image_size=(64, 48), filler_words=80, client="aiohttp"
        )
        summary = await run_traced(spec, users=1, turns=3, conversations=2, nats_url=url.group(1), namespace="default")
    finally:
        code = up.stop(signal.SIGINT)
        procs.stop_all()
    assert code == 0, up.text()[-3000:]
    assert (summary["completed"], summary["failed"]) == (6, 0)
    assert [t["completed"] for t in summary["per_turn"]] == [2, 2, 2]
    first, later = summary["breakdown"]["turn 1"], summary["breakdown"]["turns after the first"]
    assert (first["requests"], later["requests"]) == (2, 4)
    steps = {label: {s["step"] for s in b["steps"]} for label, b in (("first", first), ("later", later))}
    assert any(s.endswith(": encode") for s in steps["first"]), steps
    assert not any(s.endswith(": encode") for s in steps["later"]), steps
    assert "turns after the first" in format_summary(summary)
