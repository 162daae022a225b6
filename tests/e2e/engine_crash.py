"""What the engine-backed crash tests share (tests/vllm, tests/sglang): a
worker and its engine's processes SIGKILLed mid-stream, the reply stream
read until the request ends on another worker; a worker's readiness probed
until it is gone."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import psutil

from pipeline.connection import connect
from pipeline.replies import stored_chunks
from pipeline.subjects import Subjects
from schemas.chunk import TokenChunk
from schemas.codec import CONTENT_TYPE, MSGPACK, encode
from schemas.request import GenerateRequest
from tests.e2e.processes import Proc, Processes


async def start_nats(procs: Processes, data_dir: str) -> str:
    """A nats-server of the test's own (port 0): its URL."""
    nats = procs.start("nats", "--data-dir", data_dir, "--port", "0")
    await asyncio.to_thread(nats.wait_for, "nats-server ready", 60)
    found = re.search(r"nats-server ready: (\S+)", nats.text())
    assert found is not None
    return found.group(1)


def kill_tree(proc: Proc) -> None:
    """SIGKILL a worker and its engine's processes under it, as a container's death would."""
    parent = psutil.Process(proc.popen.pid)
    for child in parent.children(recursive=True):
        child.kill()
    proc.kill()


def events(proc: Proc, name: str, rid: str) -> list[dict[str, Any]]:
    """A worker's logged events ``name`` of request ``rid``."""
    lines = [line for line in proc.text().splitlines() if line.startswith("{") and f'"{name}"' in line]
    found = [json.loads(line) for line in lines]
    return [e for e in found if e.get("event") == name and e.get("request_id") == rid]


async def killed_mid_stream(
    nats_url: str, request: GenerateRequest, workers: list[Proc], started: Callable[[Proc], bool]
) -> tuple[list[TokenChunk], list[TokenChunk], Proc]:
    """Publish ``request``; once the client holds a few tokens, kill the
    worker of ``workers`` that ``started`` it; read the reply stream until
    the request ends. (tokens the client held at the kill, every token
    chunk at the end, the worker killed)."""
    rid = request.request_id
    subjects = Subjects("default")
    nc, js = await connect(nats_url, name=f"test-{rid}")
    try:
        await js.publish(subjects.requests, encode(request), headers={CONTENT_TYPE: MSGPACK, "Nats-Msg-Id": rid})
        # Deadlines, not counts: a fresh engine's first forward on a busy
        # 2-core machine took over 20 s.
        held: list[TokenChunk] = []
        deadline = time.monotonic() + 240
        while len(held) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            held = [c for c in await stored_chunks(js, subjects, rid) if isinstance(c, TokenChunk)]
        assert len(held) >= 3, [w.text()[-2000:] for w in workers]
        first = next(w for w in workers if started(w))
        kill_tree(first)
        chunks: list[TokenChunk] = []
        deadline = time.monotonic() + 300
        while not (chunks and chunks[-1].finish_reason is not None) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            chunks = [c for c in await stored_chunks(js, subjects, rid) if isinstance(c, TokenChunk)]
    finally:
        await nc.close()
    return held, chunks, first


async def stop_at_once(procs: Processes) -> None:
    """Every process told to stop at once (each engine takes seconds), then waited for."""
    for proc in procs.procs:
        if proc.popen.poll() is None:
            proc.popen.terminate()
    await asyncio.to_thread(procs.stop_all)


def probe(url: str) -> tuple[int, dict[str, Any]]:
    """A health endpoint's status and JSON body."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


async def readiness_until_gone(worker: psutil.Process, url: str, within_s: float = 60) -> list[tuple[int, str]]:
    """The worker's readiness (status code, its status) until the process
    is gone, or ``within_s``."""
    seen: list[tuple[int, str]] = []
    deadline = time.monotonic() + within_s
    while worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        try:
            status, body = await asyncio.to_thread(probe, url)
            seen.append((status, body.get("status", "")))
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass  # the worker has stopped listening, or is stopping
        await asyncio.sleep(0.05)
    return seen
