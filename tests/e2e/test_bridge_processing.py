"""A bridge that processes requests itself (pipeline/bridge/processing.py):
no processor worker, each request queued straight for its first hop, the
same tokens as generate(), and a bad request answered before anything is
queued. One stack per mode that splits the work, a real nats-server, the
official client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest

from pipeline.config import PipelineConfig
from schemas.routes import MODES, PROCESSOR
from stages.models import ModelSpec
from tests.e2e.conftest import N, Stack, ask, client, gradient, png_data_url, start_stack


@pytest.fixture(params=["epd", "e-p-d"])
async def processing_stack(
    request: pytest.FixtureRequest, pipeline_config: PipelineConfig, model_spec: ModelSpec
) -> AsyncIterator[Stack]:
    import dataclasses

    config = dataclasses.replace(pipeline_config, mode=request.param)
    stack, stop = await start_stack(config, model_spec, bridge_processes=True)
    yield stack
    await stop()


async def _queues_empty(stack: Stack) -> dict[str, tuple[int, int]]:
    """Each hop stream's messages and its consumer's unacknowledged ones, once both are 0 (or the deadline)."""
    js = stack.nc.jetstream()
    subjects = stack.config.subjects
    deadline = time.monotonic() + 10
    while True:
        state = {}
        for role in dict.fromkeys(MODES[stack.config.mode]):
            info = await js.consumer_info(subjects.stream(role), subjects.durable(role))
            state[role] = ((await js.stream_info(subjects.stream(role))).state.messages, info.num_ack_pending)
        if all(v == (0, 0) for v in state.values()) or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.05)


@pytest.mark.e2e
async def test_the_bridge_queues_for_the_first_hop_and_gives_generates_tokens(
    processing_stack: Stack, reference: Any
) -> None:
    stack = processing_stack
    assert PROCESSOR not in {w.role for w in stack.workers}
    image = gradient(64, 48, 1)
    content = [{"type": "image_url", "image_url": {"url": png_data_url(image)}}, {"type": "text", "text": "What?"}]
    async with client(stack) as c:
        for stream in (True, False):
            text, usage = await ask(c, content, stream=stream)
            assert (text, usage) == (reference(content, [image], N)[1], N)
        text, _ = await ask(c, "Say something.", stream=True)
        assert text == reference("Say something.", [], N)[1]
        models = await c.models.list()
        assert [m.id for m in models.data] == [stack.spec.served_name]
    # The image requests' first hop took them from its own queue (a text-only
    # request may start later on the route: e-p-d's skips the encode hop).
    first = next(w for w in stack.workers if w.role == MODES[stack.config.mode][0])
    assert first.handled >= 2
    async with aiohttp.ClientSession() as http, http.get(f"{stack.base_url}/health") as r:
        body = await r.json()
    assert r.status == 200 and PROCESSOR not in body["roles"], body


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("kw", "status", "code"),
    [
        ({"messages": []}, 400, "invalid_request"),
        ({"model": "nope"}, 404, "model_not_found"),
        ({"max_tokens": 10**6}, 400, "context_length_exceeded"),
        ({"temperature": 7.0}, 400, "invalid_request"),
        (
            {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "data:,"}}]}]},
            422,
            "unsupported_media",
        ),
    ],
)
async def test_a_bad_request_is_answered_by_the_bridge_and_nothing_is_queued(
    processing_stack: Stack, kw: dict[str, Any], status: int, code: str
) -> None:
    stack = processing_stack
    handled = {id(w): w.handled for w in stack.workers}
    args: dict[str, Any] = {"model": stack.spec.served_name, "messages": [{"role": "user", "content": "Hi"}], **kw}
    async with client(stack) as c:
        with pytest.raises(openai.APIStatusError) as raised:
            await c.chat.completions.create(max_tokens=args.pop("max_tokens", 2), **args)
    assert (raised.value.status_code, raised.value.body["code"]) == (status, code)  # type: ignore[index]
    assert raised.value.request_id  # the answer still names the request
    assert {id(w): w.handled for w in stack.workers} == handled  # no worker saw it
    assert all(v == (0, 0) for v in (await _queues_empty(stack)).values())
    async with client(stack) as c:  # and the stack serves on
        _, usage = await ask(c, "Say something.", stream=False)
    assert usage == N
