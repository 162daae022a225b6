"""Sleep mode as vLLM's endpoints, fanned out by the bridge to a role's
workers over NATS, on real workers and the tiny model: under load the
worker hands back what it holds, stops fetching, leaves the live set and
frees its KV cache (level 1) or its weights too (level 2); waking reloads
and rejoins, and every request, queued before or during the sleep, is
answered exactly once with generate()'s tokens."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from pipeline.config import PipelineConfig
from pipeline.health import WorkerHealth
from schemas.codec import Decoder
from schemas.control import WorkerInfo
from stages.models import ModelSpec
from tests.e2e.conftest import N, ask, client, start_stack

ROLE = "encode+prefill+decode"


async def until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def _call(session: aiohttp.ClientSession, method: str, url: str) -> tuple[int, Any]:
    async with session.request(method, url) as response:
        return response.status, await response.json()


@pytest.mark.e2e
@pytest.mark.parametrize("engine_process", [False, True], ids=["engine", "engine-process"])
async def test_sleep_under_load_loses_nothing_and_waking_serves_again(
    pipeline_config: PipelineConfig, model_spec: ModelSpec, reference: Any, engine_process: bool
) -> None:
    """In the worker's process or in its engine core's (--engine-process)."""
    # No grace: what the worker holds when it goes to sleep goes back to the queue at once.
    stack, stop = await start_stack(pipeline_config, model_spec, drain_grace_s=0.0, engine_process=engine_process)
    openai_client = client(stack)
    session = aiohttp.ClientSession()
    base = stack.base_url
    try:
        [worker] = [w for w in stack.workers if w.role == ROLE]
        health = WorkerHealth()
        health.worker = worker
        prompts = [f"Say something about the number {i}." for i in range(6)]
        expected = [reference(p, [])[1] for p in prompts]
        running = [asyncio.create_task(ask(openai_client, p, stream=True)) for p in prompts]
        await until(lambda: worker.handled >= 3)  # some of them in flight

        status, body = await _call(session, "POST", f"{base}/sleep?level=1&role={ROLE}")
        assert status == 200, body
        [state] = body["workers"]
        assert body["is_sleeping"] and state["sleeping"] == 1
        assert state["held_before"]["kv_cache"] > 0 and state["held"]["kv_cache"] == 0
        # Out of the live set: its ping says so, readiness is 503, the bridge's health counts it out.
        reply = await worker.nc.request(worker.subjects.ping(ROLE), b"", timeout=2)
        assert Decoder(WorkerInfo).decode(reply.data).sleeping == 1
        ready, verdict = await health.readiness()
        assert not ready and verdict["status"] == "sleeping"
        status, body = await _call(session, "GET", f"{base}/health")
        assert status == 503 and body["roles"][ROLE] is False
        status, body = await _call(session, "GET", f"{base}/is_sleeping")
        assert status == 200 and body["is_sleeping"] is True
        # Asleep, it takes nothing: a request queued now waits for it.
        handled = worker.handled
        later = asyncio.create_task(ask(openai_client, "Say something.", stream=False))
        await asyncio.sleep(1.5)  # more than a turn of the fetch loop
        assert worker.handled == handled and not later.done()

        status, body = await _call(session, "POST", f"{base}/wake_up?role={ROLE}")
        assert status == 200 and body["workers"][0]["sleeping"] == 0 and body["workers"][0]["held"]["kv_cache"] > 0
        assert not body["is_sleeping"]
        # Every request answered once, with generate()'s tokens: those it held were handed back and run again.
        answers = await asyncio.wait_for(asyncio.gather(*running, later), 120)
        assert answers == [(text, N) for text in [*expected, reference("Say something.", [])[1]]]
        assert (await health.readiness())[0]

        # Level 2: the weights go too, and come back from the checkpoint.
        status, body = await _call(session, "POST", f"{base}/sleep?level=2")
        assert status == 200 and body["workers"][0]["held"] == {"weights": 0, "kv_cache": 0}
        status, body = await _call(session, "POST", f"{base}/wake_up")
        assert status == 200 and body["workers"][0]["held"]["weights"] > 0
        assert await ask(openai_client, prompts[0], stream=True) == (expected[0], N)

        status, body = await _call(session, "POST", f"{base}/sleep?level=3")
        assert status == 400 and "level" in body["error"]["message"]
        status, body = await _call(session, "POST", f"{base}/sleep?role=decode")
        assert status == 400 and "role" in body["error"]["message"]
    finally:
        await session.close()
        await openai_client.close()
        await stop()
