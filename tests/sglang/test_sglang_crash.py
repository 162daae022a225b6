"""A SGLang worker killed mid-stream: E/PD's prefill+decode worker, or
E/P/D's decode worker, with SGLang's scheduler and detokenizer processes
under it, SIGKILLed after the client got a few tokens. The other worker of
that role takes the request over once the message's ack wait runs out: the
image's embeddings went with the dead worker's read (and in E/P/D the
prefill engine's KV with its room), so the request restarts from its encode
hop, the new prompt being the old one plus the tokens the client holds; the
reply stream ends with exactly generate()'s tokens, each once, seq in order.

Workers started one by one (``mmpipe up`` stops the whole deployment when
one of its children dies). Last, SGLang's own processes killed under a
worker: it reports engine_dead and stops."""

from __future__ import annotations

import asyncio
from pathlib import Path

import psutil
import pytest

from schemas.request import ChatMessage, GenerateRequest, ImagePart, ImageURL, SamplingParams, TextPart
from tests.e2e.conftest import gradient, make_reference, png_data_url
from tests.e2e.engine_crash import events, killed_mid_stream, probe, readiness_until_gone, start_nats, stop_at_once
from tests.e2e.processes import Proc, Processes
from tests.sglang.test_sglang_engine import sglang_up

N = 300
MODEL = "tiny-qwen2-vl"
PROMPT = "What is in the picture?"


@pytest.mark.e2e
@pytest.mark.timeout(600)  # four or five workers, two or three SGLang engines, started within the test
@pytest.mark.parametrize(("mode", "role"), [("e-pd", "prefill+decode"), ("e-p-d", "decode")])
async def test_killed_sglang_worker_request_completes_on_the_other_exactly_once(
    tmp_path: Path, mmpipe_home: Path, mode: str, role: str
) -> None:
    procs = Processes(tmp_path, mmpipe_home)
    try:
        nats_url = await start_nats(procs, str(tmp_path / "data"))
        # A short ack wait: the dead worker's message goes to the other one in
        # seconds (not so short that a live worker starved of the CPU for a
        # few seconds, on a busy 2-core machine, loses its message while it
        # runs it: its heartbeats come a third of the wait apart); a short
        # drain: nothing is in flight at the end.
        common = ["--mode", mode, "--nats-url", nats_url, "--model", MODEL, "--transport", "nats"]
        common += ["--ack-wait", "10", "--drain-grace", "2"]
        workers = [procs.start("worker", other, *common) for other in ("processor", "encode")]
        if role == "decode":
            workers.append(procs.start("worker", "prefill", *common, "--engine", "sglang"))
        engines = [procs.start("worker", role, *common, "--engine", "sglang") for _ in range(2)]
        for proc in [*workers, *engines]:
            await asyncio.to_thread(proc.wait_for, "worker_started", 300)

        image = gradient(64, 48, 5)
        rid = "killed-sglang-worker"
        request = GenerateRequest(
            request_id=rid,
            model=MODEL,
            messages=[ChatMessage(role="user", content=[ImagePart(ImageURL(png_data_url(image))), TextPart(PROMPT)])],
            sampling=SamplingParams(max_tokens=N, temperature=0, min_tokens=N),
        )

        def started(proc: Proc) -> bool:
            return bool(events(proc, "sglang_decode_started", rid))

        held, chunks, first = await killed_mid_stream(nats_url, request, engines, started)
        other = engines[1 - engines.index(first)]
        assert len(held) < N  # killed mid-stream
        assert [c.seq for c in chunks] == list(range(N))  # each token once, in order
        content = [{"type": "image_url", "image_url": {"url": ""}}, {"type": "text", "text": PROMPT}]
        from stages.models import builtin_path

        expected, _ = make_reference(builtin_path(MODEL))(content, [image], N)
        assert [t for c in chunks for t in c.token_ids] == expected
        # The other worker went on after the tokens the client held.
        resumed = [e["resumed"] for e in events(other, "sglang_decode_started", rid)]
        assert any(r >= len(held) for r in resumed), other.text()[-3000:]
    finally:
        await stop_at_once(procs)


@pytest.mark.e2e
@pytest.mark.timeout(300)
async def test_sglang_processes_killed_fail_readiness_and_stop_the_worker(tmp_path: Path, mmpipe_home: Path) -> None:
    """SGLang's scheduler and detokenizer (the worker's child processes)
    SIGKILLed: the worker's readiness says engine_dead (503) from then on,
    the worker stops rather than take work it would fail, and ``mmpipe up``
    stops the deployment with it."""
    with sglang_up(tmp_path, mmpipe_home, "epd") as stack:
        role = "encode+prefill+decode"
        url = stack.metrics[role].replace("/metrics", "/health/ready")
        assert (await asyncio.to_thread(probe, url))[0] == 200
        worker = next(p for p in psutil.Process(stack.up.popen.pid).children() if role in p.cmdline())
        children = worker.children(recursive=True)
        assert children
        for child in children:
            child.kill()
        seen = await readiness_until_gone(worker, url)
        # Not ready once the worker has seen SGLang's processes gone (probes in
        # the moment before it still pass); then gone rather than left serving errors.
        dead = next((i for i, (status, _) in enumerate(seen) if status == 503), None)
        assert dead is not None, seen[-5:]
        assert all(status == 503 for status, _ in seen[dead:]), seen
        assert {status for _, status in seen[dead:]} <= {"engine_dead", "draining"}, seen
        assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE
        assert '"sglang_engine_dead"' in stack.up.text()
        # mmpipe up stops the deployment when a worker exits.
        assert await asyncio.to_thread(stack.up.popen.wait, 60) == 1
