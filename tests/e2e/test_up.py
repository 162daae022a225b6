"""``mmpipe up`` as a user runs it, in every mode: the embedded nats-server,
every worker as its own OS process, the bridge; the official openai client
gets exactly generate()'s tokens; then Ctrl-C stops all of it."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import msgspec
import openai
import psutil
import pytest

from pipeline.connection import connect, shutdown
from pipeline.discovery import record_nats_url
from pipeline.subjects import Subjects
from schemas.control import WorkerInfo
from schemas.routes import MODES
from tests.e2e.conftest import gradient, png_data_url
from tests.e2e.processes import Processes
from tests.polling import eventually

N = 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ask(client: openai.OpenAI, content: Any, stream: bool) -> str:
    kw: dict[str, Any] = {"max_tokens": N, "temperature": 0, "extra_body": {"min_tokens": N}}
    messages: Any = [{"role": "user", "content": content}]
    if not stream:
        return (
            client.chat.completions.create(model="tiny-qwen2-vl", messages=messages, **kw).choices[0].message.content
            or ""
        )
    chunks = client.chat.completions.create(model="tiny-qwen2-vl", messages=messages, stream=True, **kw)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("mode", "processors"),
    # The bridge processes requests (the default), or processor workers do.
    [(mode, 0) for mode in MODES] + [("e-p-d", 1)],
)
def test_up_serves_every_mode_as_processes_and_stops_cleanly(
    mode: str, processors: int, tmp_path: Path, mmpipe_home: Path, tiny_model_dir: Path, reference: Any
) -> None:
    port = _free_port()
    procs = Processes(tmp_path, mmpipe_home)
    hops = MODES[mode]
    # Two workers of the last role, placed: scaling out is starting more of them.
    workers = f"{hops[-1]}=2@cpu" + (f",processor={processors}" if processors else "")
    up = procs.start(
        "up", "--mode", mode, "--port", str(port), "--data-dir", str(tmp_path / "data"),
        "--workers", workers, "--transport", "nixl",
    )  # fmt: skip
    try:
        up.wait_for("mmpipe ready")
        ready = next(line for line in up.text().splitlines() if "mmpipe ready" in line)
        assert ("processed in the bridge" in ready) == (not processors), ready
        assert f"{hops[-1]}×2@cpu" in ready, ready
        children = psutil.Process(up.popen.pid).children(recursive=True)
        started = sorted(" ".join(c.cmdline()[3:5]) for c in children if "pipeline.cli" in c.cmdline())
        assert started == sorted(
            # Their settings ride in the environment, not on the command line.
            # One processor worker at least: for NATS callers where the bridge processes its own requests.
            [*["worker processor"] * max(processors, 1), *(f"worker {h}" for h in hops), f"worker {hops[-1]}", "bridge"]
        )
        assert any("nats-server" in c.name() for c in children)

        one, two = gradient(64, 48, 1), gradient(40, 72, 5)
        single = [{"type": "image_url", "image_url": {"url": png_data_url(one)}}, {"type": "text", "text": "What?"}]
        pair = [
            {"type": "text", "text": "Compare"},
            {"type": "image_url", "image_url": {"url": png_data_url(one)}},
            {"type": "text", "text": "and"},
            {"type": "image_url", "image_url": {"url": png_data_url(two)}},
        ]
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0) as client:
            assert _ask(client, single, stream=True) == reference(single, [one], N)[1]
            assert _ask(client, pair, stream=False) == reference(pair, [one, two], N)[1]
            assert _ask(client, "Say something.", stream=True) == reference("Say something.", [], N)[1]
        if mode == "epd":
            events = [json.loads(line) for line in up.text().splitlines() if line.startswith("{")]
            # What each model worker did before it was ready, with its figures.
            loaded = [e for e in events if e["event"] == "model_load_done"]
            pools = [e for e in events if e["event"] == "kv_cache_allocated"]
            assert len(loaded) == len(pools) == 2 and all(e["gib"] > 0 for e in loaded + pools)
            assert all(e["tokens"] > 0 for e in pools)
            # Every worker's /metrics is up with no flag: each got a port of its own, logged at start.
            logged = [e for e in events if e["event"] == "worker_health_port"]
            assert sorted(e["role"] for e in logged) == ["encode+prefill+decode"] * 2 + ["processor"]
            # The ready line names them too: which port is whose /metrics.
            ports = [f"{e['role']} :{e['metrics'].split(':')[-1].split('/')[0]}" for e in logged]
            assert ready.endswith(f"metrics: {', '.join(ports)}"), ready
            for event in logged:
                with urllib.request.urlopen(event["metrics"], timeout=10) as r:
                    assert b"mmpipe_" in r.read()
            # `mmpipe send` beside it, with no flags but the data dir: it finds the server `up` recorded.
            sent = subprocess.run(
                [sys.executable, "-m", "pipeline.cli", "send", "--data-dir", str(tmp_path / "data"),
                 "--max-tokens", str(N), "--model", "tiny-qwen2-vl", "Say something."],
                capture_output=True, text=True, timeout=120, env=procs.env,
            )  # fmt: skip
            assert sent.returncode == 0, sent.stderr[-3000:]
            text, finish = sent.stdout.split("\n[finish=")
            # No min_tokens on `send`: it may stop at EOS, where generate() was held past it.
            assert reference("Say something.", [], N)[1].startswith(text) and finish.startswith(("length", "stop"))
    finally:
        code = up.stop(signal.SIGINT)
        procs.stop_all()
    assert code == 0, up.text()[-3000:]
    assert all(_gone(c) for c in children)
    assert "Traceback" not in up.text()
    assert not (tmp_path / "data" / "nats.url").exists()  # its server is gone: no record of it left


def _gone(process: psutil.Process) -> bool:
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.e2e
async def test_what_a_killed_worker_started_is_stopped_with_it(
    tmp_path: Path, mmpipe_home: Path, tiny_model_dir: Path
) -> None:
    """A worker SIGKILLed stops nothing it started: here its media
    processes, elsewhere vLLM's or SGLang's engine core, each holding its
    memory. `mmpipe up` stops (1, as whenever a worker exits) and kills
    what is left of that worker's process group."""
    port = _free_port()
    procs = Processes(tmp_path, mmpipe_home)
    up = procs.start("up", "--port", str(port), "--data-dir", str(tmp_path / "data"), "--media-processes", "1")
    try:
        up.wait_for("mmpipe ready")
        worker = next(
            c
            for c in psutil.Process(up.popen.pid).children()
            if "pipeline.cli" in c.cmdline() and "encode+prefill+decode" in c.cmdline()
        )
        image = [{"type": "image_url", "image_url": {"url": png_data_url(gradient(64, 48, 1))}}]
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0) as client:
            _ask(client, [*image, {"type": "text", "text": "What?"}], stream=False)  # the pool starts its process
        started = worker.children(recursive=True)
        assert any(any("spawn_main" in part for part in c.cmdline()) for c in started), started
        worker.kill()
        code = up.popen.wait(120)
    finally:
        up.stop(signal.SIGINT)
        procs.stop_all()
    assert code == 1, up.text()[-3000:]
    try:
        await eventually(lambda: all(_gone(c) for c in started), within=30)
    finally:
        for left in (c for c in started if not _gone(c)):
            left.kill()  # this test's failure leaves nothing running


def test_send_with_no_server_fails_in_seconds_saying_where_it_looked(tmp_path: Path) -> None:
    dead = f"nats://127.0.0.1:{_free_port()}"
    sent = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "send", "--nats-url", dead, "--connect-timeout", "1", "hello"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert sent.returncode == 2, sent.stderr[-3000:]
    assert f"no NATS server answered at {dead} (--nats-url) within 1 s" in sent.stderr
    # Without --nats-url: what an `mmpipe up` recorded in the data dir (one that died without cleaning up here).
    record_nats_url(tmp_path, dead)
    sent = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "send", "--data-dir", str(tmp_path), "--connect-timeout", "1", "hi"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert sent.returncode == 2, sent.stderr[-3000:]
    assert f"{dead} (recorded in {tmp_path / 'nats.url'} by mmpipe up)" in sent.stderr


async def _max_inflight(ready_line: str, role: str) -> int:
    """What the running worker of ``role`` answers a ping with."""
    url = re.search(r"nats=(\S+)", ready_line)
    assert url, ready_line
    nc, _ = await connect(url.group(1), name="test-ping")
    try:
        reply = await nc.request(Subjects("default").ping(role), b"", timeout=5)
    finally:
        await shutdown(nc)
    return msgspec.msgpack.decode(reply.data, type=WorkerInfo).max_inflight


@pytest.mark.e2e
@pytest.mark.parametrize("source", ["flag", "variable", "config file", "default"])
async def test_a_setting_from_each_source_reaches_the_worker(
    source: str, tmp_path: Path, mmpipe_home: Path, tiny_model_dir: Path
) -> None:
    procs = Processes(tmp_path, mmpipe_home)
    flags = ["--port", str(_free_port()), "--data-dir", str(tmp_path / "data"), "--model", str(tiny_model_dir)]
    if source == "flag":
        flags += ["--max-inflight", "32", "--max-num-seqs", "8"]
    elif source == "variable":
        procs.env |= {"MMPIPE_MAX_INFLIGHT": "32", "MMPIPE_MAX_NUM_SEQS": "8"}
    elif source == "config file":
        (tmp_path / "mmpipe.toml").write_text("max_inflight = 32\nmax-num-seqs = 8\n")
        flags += ["--config", str(tmp_path / "mmpipe.toml")]
    else:
        flags += ["--max-num-seqs", "24"]
    up = procs.start("up", *flags)
    try:
        up.wait_for("mmpipe ready")
        ready = next(line for line in up.text().splitlines() if "mmpipe ready" in line)
        # Unset, a worker holds as many requests as its batch decoder runs.
        assert await _max_inflight(ready, "encode+prefill+decode") == (24 if source == "default" else 32)
    finally:
        code = up.stop(signal.SIGINT)
        procs.stop_all()
    assert code == 0, up.text()[-3000:]


@pytest.mark.e2e
def test_up_with_the_engine_in_its_own_process_serves_and_stops_cleanly(
    tmp_path: Path, mmpipe_home: Path, tiny_model_dir: Path, reference: Any
) -> None:
    port = _free_port()
    procs = Processes(tmp_path, mmpipe_home)
    up = procs.start("up", "--port", str(port), "--data-dir", str(tmp_path / "data"), "--engine-process")
    try:
        up.wait_for("mmpipe ready")
        worker = next(
            c
            for c in psutil.Process(up.popen.pid).children(recursive=True)
            if "pipeline.cli" in c.cmdline() and "encode+prefill+decode" in c.cmdline()
        )
        cores = [c for c in worker.children() if any("spawn_main" in part for part in c.cmdline())]
        assert len(cores) == 1, [c.cmdline() for c in worker.children()]
        assert f"pid={cores[0].pid}" in up.text() or f'"pid": {cores[0].pid}' in up.text()
        image = gradient(64, 48, 1)
        single = [{"type": "image_url", "image_url": {"url": png_data_url(image)}}, {"type": "text", "text": "What?"}]
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0) as client:
            assert _ask(client, single, stream=True) == reference(single, [image], N)[1]
            assert _ask(client, "Say something.", stream=False) == reference("Say something.", [], N)[1]
    finally:
        # Ctrl-C: `mmpipe up` stops each worker, which closes its core.
        code = up.stop(signal.SIGINT)
        procs.stop_all()
    assert code == 0, up.text()[-3000:]
    assert _gone(cores[0])
    assert "Traceback" not in up.text()
