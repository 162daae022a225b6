"""A worker's health and metrics endpoints against a real nats-server: ready
follows the connection and the consumer, live follows progress, /metrics is
the process's Prometheus registry."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from pipeline.config import PipelineConfig
from pipeline.connection import connect
from pipeline.health import LIVE_PATH, METRICS_PATH, READY_PATH, HealthSettings, WorkerHealth
from pipeline.nats_server import NatsServer, NatsServerConfig
from pipeline.worker import Worker
from schemas.chunk import FinishReason, TokenChunk
from schemas.codec import encode
from schemas.processed import ProcessedRequest
from schemas.request import ChatMessage, GenerateRequest
from stages.contract import HopContext, StageOutput


class WordsStage:
    """One token per word; waits ``pause_s`` before each (a request that makes no progress)."""

    role = "processor"
    input_type = GenerateRequest
    resumes_stream = True
    models = ["words"]  # noqa: RUF012

    def __init__(self, pause_s: float = 0.0) -> None:
        self.pause_s = pause_s
        self.done = asyncio.Event()

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def has_room(self) -> bool:
        return True

    async def run(
        self, message: GenerateRequest | ProcessedRequest, ctx: HopContext
    ) -> AsyncGenerator[StageOutput, None]:
        assert isinstance(message, GenerateRequest)
        words = str(message.messages[0].content).split()
        for i, word in enumerate(words):
            await asyncio.sleep(self.pause_s)
            last = i == len(words) - 1
            yield TokenChunk(message.request_id, i, [len(word)], word, FinishReason.STOP if last else None)
        self.done.set()


Probe = Callable[[str], Awaitable[tuple[int, Any]]]


@pytest.fixture
async def probe() -> AsyncIterator[Callable[[WorkerHealth], Awaitable[Probe]]]:
    """Serves a WorkerHealth on a free loopback port; returns a GET helper."""
    served: list[WorkerHealth] = []
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))

    async def serve(health: WorkerHealth) -> Probe:
        port = await health.serve(port=0)
        served.append(health)

        async def get(path: str) -> tuple[int, Any]:
            async with session.get(f"http://127.0.0.1:{port}{path}") as response:
                body = await response.json() if path != METRICS_PATH else await response.text()
                return response.status, body

        return get

    yield serve
    await session.close()
    for health in served:
        await health.close()


async def until(
    get: Probe, path: str, status: int, timeout_s: float = 10.0, also: Callable[[Any], bool] = lambda body: True
) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got, body = await get(path)
        if got == status and also(body):
            return body
        assert time.monotonic() < deadline, f"{path} stayed {got} {body}, wanted {status}"
        await asyncio.sleep(0.05)


async def start_worker(config: PipelineConfig, stage: WordsStage, **kw: Any) -> tuple[Worker, asyncio.Task[None]]:
    nc, js = await connect(config.nats_url, "test-worker")
    worker = Worker(nc, js, config, stage, **kw)
    task = asyncio.create_task(worker.run())
    await asyncio.wait_for(worker.ready.wait(), 10)
    return worker, task


async def stop_worker(worker: Worker, task: asyncio.Task[None]) -> None:
    worker.stop()
    await asyncio.wait_for(task, 20)
    await worker.nc.close()


def request(rid: str, text: str) -> GenerateRequest:
    # `created` as the bridge sets it: time to first token counts from it.
    return GenerateRequest(request_id=rid, model="words", messages=[ChatMessage("user", text)], created=time.time())


async def test_ready_needs_the_consumer(pipeline_config: PipelineConfig, nats_client: Any, probe: Any) -> None:
    health = WorkerHealth()
    get = await probe(health)
    # No worker yet (connecting, loading its model): live, not ready.
    assert (await get(READY_PATH))[0] == 503
    assert await get(LIVE_PATH) == (200, {"status": "starting"})

    worker, task = await start_worker(pipeline_config, WordsStage())
    health.worker = worker
    body = await until(get, READY_PATH, 200)
    assert body["consumer"] is True and body["nats"] is True and body["role"] == "processor"
    assert (await get(LIVE_PATH))[1]["status"] == "live"

    # Someone deletes the role's durable: this worker can no longer take work.
    _, js = nats_client
    s = pipeline_config.subjects
    await js.delete_consumer(s.stream("processor"), s.durable("processor"))
    body = await until(get, READY_PATH, 503)
    assert body["status"] == "consumer_missing" and body["consumer"] is False

    worker.stop()
    await asyncio.wait_for(task, 20)
    assert (await get(READY_PATH))[1]["status"] == "draining"
    await worker.nc.close()


async def test_ready_follows_the_nats_connection(tmp_path: Path, namespace: str, probe: Any) -> None:
    server = NatsServer(NatsServerConfig(data_dir=tmp_path / "nats", port=0))
    server.start()
    config = PipelineConfig(nats_url=server.url, namespace=namespace)
    health = WorkerHealth()
    get = await probe(health)
    worker, task = await start_worker(config, WordsStage())
    health.worker = worker
    try:
        await until(get, READY_PATH, 200)
        server.stop()
        # At once 503 (its JetStream calls fail); then it knows the connection is gone.
        body = await until(get, READY_PATH, 503, also=lambda body: body["nats"] is False)
        assert body["status"] == "nats_disconnected"
        # A NATS outage is no reason to restart the worker.
        assert (await get(LIVE_PATH))[0] == 200
        # The same server comes back: the worker reconnects and is ready again.
        port = int(server.url.rsplit(":", 1)[1])
        server = NatsServer(NatsServerConfig(data_dir=tmp_path / "nats", port=port))
        server.start()
        await until(get, READY_PATH, 200, timeout_s=15)
    finally:
        await stop_worker(worker, task)
        server.stop()


async def test_live_turns_503_while_no_request_progresses(
    pipeline_config: PipelineConfig, nats_client: Any, probe: Any
) -> None:
    stage = WordsStage(pause_s=1.5)
    health = WorkerHealth(HealthSettings(stall_after_s=0.5))
    get = await probe(health)
    # One slot: while its request makes no progress, nothing else moves either.
    worker, task = await start_worker(pipeline_config, stage, max_inflight=1)
    health.worker = worker
    try:
        await until(get, LIVE_PATH, 200)
        _, js = nats_client
        await js.publish(pipeline_config.subjects.requests, encode(request("r-slow", "one two")))
        body = await until(get, LIVE_PATH, 503, timeout_s=5)
        assert body["status"] == "stuck" and body["since_progress_s"] >= 0.5
        await asyncio.wait_for(stage.done.wait(), 10)
        await until(get, LIVE_PATH, 200, timeout_s=5)
    finally:
        await stop_worker(worker, task)


async def test_metrics_expose_the_workers_series(pipeline_config: PipelineConfig, nats_client: Any, probe: Any) -> None:
    health = WorkerHealth()
    get = await probe(health)
    stage = WordsStage()
    worker, task = await start_worker(pipeline_config, stage)
    health.worker = worker
    try:
        nc, js = nats_client
        sub = await nc.subscribe(pipeline_config.subjects.reply("r-metrics"))
        await js.publish(pipeline_config.subjects.requests, encode(request("r-metrics", "a b c")))
        for _ in range(3):
            await sub.next_msg(timeout=10)
        await asyncio.wait_for(stage.done.wait(), 10)
        # Ack is settled right after the last chunk; give it a moment to count.
        deadline = time.monotonic() + 5
        while True:
            status, text = await get(METRICS_PATH)
            if 'mmpipe_messages_total{outcome="ack",role="processor"}' in text or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        assert status == 200
        assert 'mmpipe_messages_total{outcome="ack",role="processor"}' in text
        assert 'mmpipe_stage_seconds_count{role="processor"}' in text
        assert 'mmpipe_generated_tokens_total{role="processor"}' in text
        assert 'mmpipe_time_to_first_token_seconds_count{where="processor"}' in text
        assert 'mmpipe_inter_token_latency_seconds_count{where="processor"}' in text
        assert "# TYPE mmpipe_queue_wait_seconds histogram" in text
    finally:
        await stop_worker(worker, task)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.mark.e2e
async def test_worker_process_serves_its_endpoints(
    nats_server: NatsServer, namespace: str, tiny_model_dir: Path
) -> None:
    """`mmpipe worker ... --health-port` as its own OS process: ready once it
    consumes, and SIGTERM ends it cleanly."""
    port = _free_port()
    args = [sys.executable, "-m", "pipeline.cli", "worker", "processor", "--model", str(tiny_model_dir)]
    args += ["--nats-url", nats_server.url, "--namespace", namespace, "--health-port", str(port)]
    args += ["--log-level", "WARNING"]
    proc = await asyncio.create_subprocess_exec(*args, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            deadline = time.monotonic() + 120
            while True:
                assert proc.returncode is None, "the worker exited"
                try:
                    async with session.get(f"http://127.0.0.1:{port}{READY_PATH}") as response:
                        if response.status == 200:
                            break
                except (aiohttp.ClientError, TimeoutError):
                    pass  # not listening yet, or its loop busy loading the model
                assert time.monotonic() < deadline, "the worker never became ready"
                await asyncio.sleep(0.2)
            async with session.get(f"http://127.0.0.1:{port}{LIVE_PATH}") as response:
                assert response.status == 200
            async with session.get(f"http://127.0.0.1:{port}{METRICS_PATH}") as response:
                assert "mmpipe_" in await response.text()
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
