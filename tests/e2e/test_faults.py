"""Cancellation, deadlines and poison messages on a real nats-server with
real workers (issue 5, items 5 and 6):

- a client that disconnects mid-stream stops its decode within one step,
  and the tensors held for it are freed;
- an expired deadline fails with 504 deadline_exceeded before any hop works;
- a retryable stage failure is retried with backoff up to max_deliver, then
  dead-lettered with an error chunk to the client.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from dataclasses import replace
from typing import Any

import openai
import pytest
from aiohttp import web

from pipeline import metrics
from pipeline.bridge.app import Bridge, BridgeSettings
from pipeline.config import ConsumerSettings, PipelineConfig
from pipeline.connection import connect
from pipeline.replies import CHUNK_DECODER
from pipeline.serve import WorkerSettings, build_stage
from pipeline.transport.metrics import HELD_BYTES
from pipeline.worker import Worker
from schemas.chunk import ErrorChunk
from schemas.codec import Decoder, encode
from schemas.control import DeadLetter
from schemas.errors import TransientError
from schemas.processed import ProcessedRequest
from schemas.request import ChatMessage, GenerateRequest, SamplingParams
from schemas.routes import MODES, PROCESSOR
from stages.contract import HopContext, StageOutput
from stages.models import ModelSpec
from tests.e2e.conftest import client, gradient, image_content, png_data_url, start_stack

LONG = 400


def _tokens() -> float:
    return metrics.TOKENS.labels("decode")._value.get()


def _hop_messages() -> float:
    return sum(
        metrics.MESSAGES.labels(role, outcome)._value.get()
        for role in MODES["e-p-d"]
        for outcome in ("ack", "nak", "reject")
    )


@pytest.mark.e2e
async def test_disconnect_stops_decode_within_a_step_and_frees_tensors(
    pipeline_config: PipelineConfig, model_spec: ModelSpec
) -> None:
    config = replace(pipeline_config, mode="e-p-d")
    stack, stop = await start_stack(config, model_spec)
    try:
        [decode] = [w for w in stack.workers if w.role == "decode"]
        at_cancel: list[float] = []

        async def on_cancel(msg: Any) -> None:
            at_cancel.append(_tokens())

        await stack.nc.subscribe(config.subjects.cancels, cb=on_cancel)
        before = _tokens()  # the counter is the process's: other tests' tokens are in it
        async with client(stack) as c:
            s = await c.chat.completions.create(
                model="tiny-qwen2-vl",
                messages=[{"role": "user", "content": image_content(png_data_url(gradient(64, 48, 1)))}],  # type: ignore[list-item]
                max_tokens=LONG,
                temperature=0,
                stream=True,
                extra_body={"min_tokens": LONG},
            )
            got = 0
            async for _ in s:
                got += 1
                if got == 5:
                    break
            await s.close()  # the client goes away mid-stream
            for _ in range(200):
                if at_cancel:
                    break
                await asyncio.sleep(0.02)
        assert at_cancel, "the bridge published no cancel"
        for _ in range(100):
            if decode.stage.engine.scheduler.active == 0:  # type: ignore[attr-defined]
                break
            await asyncio.sleep(0.01)
        assert decode.stage.engine.scheduler.active == 0  # type: ignore[attr-defined]
        stopped = _tokens()
        await asyncio.sleep(0.5)
        # Within one step of the cancel: at most the token of the step under way.
        assert _tokens() == stopped
        assert stopped - at_cancel[0] <= 1, (at_cancel[0], stopped)
        assert stopped - before < LONG / 2
        # Nothing is held for it any more, by any worker.
        assert all(w.tensors is None or w.tensors.held_bytes == 0 for w in stack.workers)
        assert HELD_BYTES.labels("nixl")._value.get() == 0
    finally:
        await stop()


@pytest.mark.e2e
async def test_an_expired_deadline_is_504_without_work(pipeline_config: PipelineConfig, model_spec: ModelSpec) -> None:
    config = replace(pipeline_config, mode="e-p-d")
    stack, stop = await start_stack(config, model_spec, bridge_settings=BridgeSettings(request_timeout_s=0.0))
    try:
        tokens, hops = _tokens(), _hop_messages()
        async with client(stack) as c:
            with pytest.raises(openai.APIStatusError) as raised:
                await c.chat.completions.create(
                    model="tiny-qwen2-vl", messages=[{"role": "user", "content": "Hi"}], max_tokens=8
                )
        assert raised.value.status_code == 504
        assert raised.value.body["code"] == "deadline_exceeded"  # type: ignore[index]

        # Over NATS: the processor refuses it with the same code, and no hop sees it.
        nc, js = stack.nc, stack.nc.jetstream()
        request = GenerateRequest(
            "late-1", "tiny-qwen2-vl", [ChatMessage("user", "Hi")], SamplingParams(max_tokens=8),
            created=time.time() - 10, deadline=time.time() - 1,
        )  # fmt: skip
        sub = await nc.subscribe(config.subjects.reply("late-1"))
        await js.publish(config.subjects.requests, encode(request))
        chunk = CHUNK_DECODER.decode((await sub.next_msg(timeout=30)).data)
        assert isinstance(chunk, ErrorChunk) and chunk.http_status == 504 and chunk.code == "deadline_exceeded"
        await asyncio.sleep(0.3)
        assert (_tokens(), _hop_messages()) == (tokens, hops)
    finally:
        await stop()


class FlakyEncode:
    """A test stage of the encode role whose every run fails in a way worth
    retrying (its device went away), recording when each attempt came."""

    role = "encode"
    input_type = ProcessedRequest
    resumes_stream = False

    def __init__(self) -> None:
        self.models = ["tiny-qwen2-vl"]
        self.attempts: list[float] = []

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def has_room(self) -> bool:
        return True

    async def run(self, message: Any, ctx: HopContext) -> AsyncGenerator[StageOutput, None]:
        self.attempts.append(time.monotonic())
        raise TransientError("injected: the encoder's device went away")
        yield  # a generator, like every stage


@pytest.mark.e2e
async def test_a_retryable_failure_is_retried_with_backoff_then_dead_lettered(
    pipeline_config: PipelineConfig, model_spec: ModelSpec
) -> None:
    config = replace(pipeline_config, mode="e-p-d", consumer=ConsumerSettings(max_deliver=3))
    settings = WorkerSettings(model=str(model_spec.path), served_model_name=model_spec.served_name)
    conns = []
    flaky = FlakyEncode()
    workers = []
    for role, stage in ((PROCESSOR, build_stage(PROCESSOR, config, settings, model_spec)), ("encode", flaky)):
        nc, js = await connect(config.nats_url, f"test-{role}")
        conns.append(nc)
        workers.append(Worker(nc, js, config, stage, max_inflight=4))  # type: ignore[arg-type]
    tasks = [asyncio.create_task(w.run()) for w in workers]
    for w in workers:
        await asyncio.wait_for(w.ready.wait(), 30)
    nc, js = await connect(config.nats_url, "test-bridge")
    conns.append(nc)
    dead = await js.subscribe(config.subjects.dead)
    runner = web.AppRunner(Bridge(nc, js, config, BridgeSettings()).app(), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        async with openai.AsyncOpenAI(base_url=f"http://{host}:{port}/v1", api_key="x", max_retries=0) as c:
            with pytest.raises(openai.APIStatusError) as raised:
                await c.chat.completions.create(
                    model="tiny-qwen2-vl",
                    messages=[{"role": "user", "content": image_content(png_data_url(gradient(32, 32, 1)))}],  # type: ignore[list-item]
                    max_tokens=8,
                    stream=True,
                )
        # The client hears of it, with the stage's error, once every try failed.
        assert raised.value.status_code == 503
        assert "injected" in str(raised.value.body)
        assert raised.value.response.headers.get("Retry-After")
        # max_deliver tries, each after a longer backoff (0.5 s, then 1 s).
        assert len(flaky.attempts) == 3
        gaps = [b - a for a, b in zip(flaky.attempts, flaky.attempts[1:], strict=False)]
        assert 0.45 <= gaps[0] < gaps[1] and gaps[1] >= 0.95, gaps
        letter = Decoder(DeadLetter).decode((await dead.next_msg(timeout=10)).data)
        assert (letter.code, letter.deliveries) == ("internal_error", 3)
        assert letter.subject == config.subjects.work("encode") and "injected" in letter.message
        await asyncio.sleep(1.5)  # and never again
        assert len(flaky.attempts) == 3
    finally:
        await runner.cleanup()
        for w in workers:
            w.stop()
        await asyncio.gather(*tasks)
        for conn in conns:
            await conn.close()
