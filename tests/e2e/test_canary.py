"""The canary health check on real workers, a real nats-server and the tiny
model: an idle worker pushes a tiny request (an image through the encoder,
a few tokens prefilled) through its own engine; an engine that hangs or
fails turns it unhealthy (readiness 503, its ping reply says so, the
bridge counts it out, it fetches nothing), and it recovers once a canary
passes again, with what was queued meanwhile served, not lost."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from pipeline import metrics
from pipeline.canary import CanarySettings
from pipeline.config import PipelineConfig
from pipeline.health import WorkerHealth
from pipeline.worker import Worker
from schemas.codec import Decoder
from schemas.control import WorkerInfo
from stages.models import ModelSpec
from tests.e2e.conftest import N, ask, client, start_stack

ROLE = "encode+prefill+decode"


async def until(condition: Callable[[], Any], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


def _count(metric: Any, *labels: str) -> float:
    return float(metric.labels(*labels)._value.get())


def _canaries(role: str) -> float:
    return sum(
        s.value
        for s in metrics.CANARY_SECONDS.collect()[0].samples
        if s.name.endswith("_count") and s.labels["role"] == role
    )


async def _ping(worker: Worker) -> WorkerInfo:
    reply = await worker.nc.request(worker.subjects.ping(worker.role), b"", timeout=2)
    return Decoder(WorkerInfo).decode(reply.data)


async def _bridge_health(base_url: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.get(f"{base_url}/health") as r:
        return r.status, await r.json()


@pytest.mark.e2e
async def test_an_engine_that_hangs_or_fails_turns_its_worker_unhealthy_until_a_canary_passes(
    pipeline_config: PipelineConfig, model_spec: ModelSpec, reference: Any
) -> None:
    canary = CanarySettings(interval_s=0.3, timeout_s=2.0)
    stack, stop = await start_stack(pipeline_config, model_spec, canary=canary)
    openai_client = client(stack)
    try:
        [worker] = [w for w in stack.workers if w.role == ROLE]
        health = WorkerHealth()
        health.worker = worker
        engine = worker.stage.engine  # type: ignore[attr-defined]
        # Idle: canaries run and pass.
        ran = _canaries(ROLE)
        await until(lambda: _canaries(ROLE) >= ran + 2)
        assert worker.healthy and (await health.readiness())[0]

        # The engine's thread hangs: the canary times out.
        timeouts = _count(metrics.CANARY_FAILURES, ROLE, "timeout")
        hang = threading.Event()
        engine.thread.submit(hang.wait)
        try:
            await until(lambda: not worker.healthy)
            assert _count(metrics.CANARY_FAILURES, ROLE, "timeout") == timeouts + 1
            ready, body = await health.readiness()
            assert not ready and body["status"] == "canary_failed" and "2 s" in body["error"]
            info = await _ping(worker)
            assert not info.healthy and "2 s" in info.problem
            # The bridge counts it out of its role (after its short cache of pings).
            status, body = await _bridge_health(stack.base_url)
            while body["roles"][ROLE]:
                await asyncio.sleep(0.2)
                status, body = await _bridge_health(stack.base_url)
            assert status == 503
            # A request the processor queues meanwhile waits: the worker fetches nothing.
            handled = worker.handled
            pending = asyncio.create_task(ask(openai_client, "Say something.", stream=True))
            await asyncio.sleep(1.5)  # more than one turn of the fetch loop
            assert worker.handled == handled and not pending.done()
        finally:
            hang.set()
        # The engine answers again: the next canary passes, the queued request is served.
        await until(lambda: worker.healthy)
        assert (await health.readiness())[0] and (await _ping(worker)).healthy
        assert await asyncio.wait_for(pending, 60) == (reference("Say something.", [])[1], N)

        # The engine fails: the canary's error, until it is mended.
        errors = _count(metrics.CANARY_FAILURES, ROLE, "error")
        prefill = engine.torch.prefill

        def broken(*args: Any, **kw: Any) -> Any:
            raise RuntimeError("the device fell off the bus")

        engine.torch.prefill = broken
        try:
            await until(lambda: not worker.healthy)
            assert _count(metrics.CANARY_FAILURES, ROLE, "error") >= errors + 1
            assert "fell off the bus" in (await _ping(worker)).problem
        finally:
            engine.torch.prefill = prefill
        await until(lambda: worker.healthy)
    finally:
        await openai_client.close()
        await stop()
