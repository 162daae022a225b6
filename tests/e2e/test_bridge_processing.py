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
import msgspec
import openai
import pytest

from pipeline.config import PipelineConfig
from schemas.processed import ProcessedRequest
from schemas.request import ImagePart
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


@pytest.mark.e2e
async def test_hops_past_the_encoder_carry_no_image_and_a_restart_comes_from_the_bridge(
    pipeline_config: PipelineConfig, model_spec: ModelSpec, reference: Any
) -> None:
    """E/P/D: the prefill hop's message holds no image bytes; its embeddings
    vanish before the prefill hop reads them, and the bridge, which holds
    the request as it arrived, queues it again from the encode hop."""
    import dataclasses

    config = dataclasses.replace(pipeline_config, mode="e-p-d")
    stack, stop = await start_stack(config, model_spec, bridge_processes=True, counts={"prefill": 0})
    try:
        seen: asyncio.Queue[ProcessedRequest] = asyncio.Queue()

        async def copy(msg: Any) -> None:
            await seen.put(msgspec.msgpack.decode(msg.data, type=ProcessedRequest))

        # A core subscriber gets a copy of what is published to the prefill hop's queue.
        await stack.nc.subscribe(config.subjects.work("prefill"), cb=copy)
        image = gradient(64, 48, 1)
        url = png_data_url(image)
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What?"}]
        async with client(stack) as c:
            answer = asyncio.create_task(ask(c, content, stream=True))
            first = await asyncio.wait_for(seen.get(), 30)
            assert first.media_dropped and first.bridge_restarts and first.encoded is not None
            part = first.request.messages[0].content[0]
            assert isinstance(part, ImagePart) and part.image_url.url == ""
            assert len(msgspec.msgpack.encode(first)) < len(url)  # the image is not in it, in any form
            encoder = next(w for w in stack.workers if w.role == "encode")
            assert encoder.tensors is not None
            await encoder.tensors.release(first.encoded.ref)  # as if its holder had lost it
            await stack.add_worker("prefill")
            text, usage = await asyncio.wait_for(answer, 60)
        assert (text, usage) == (reference(content, [image], N)[1], N)
        assert encoder.handled == 2  # the new attempt went through the encode hop again
        again = await asyncio.wait_for(seen.get(), 10)
        assert again.attempt == 1 and again.media_dropped
    finally:
        await stop()


@pytest.mark.e2e
async def test_a_restart_nobody_holds_the_media_for_ends_the_request(
    pipeline_config: PipelineConfig, model_spec: ModelSpec
) -> None:
    """A message without its media whose bridge is gone: restarted by no one,
    the request ends with an error that says so, at once."""
    import dataclasses

    from pipeline.transport.nixl import agent_bucket
    from schemas.codec import encode
    from schemas.processed import KvHandoff
    from schemas.request import ChatMessage, GenerateRequest, ImageURL, SamplingParams, TextPart
    from schemas.tensors import TensorRef, TensorSpec
    from stages.models.traits import load_traits
    from stages.processor import Processor

    config = dataclasses.replace(pipeline_config, mode="e-p-d")
    stack, stop = await start_stack(config, model_spec, bridge_processes=True)
    try:
        content = [ImagePart(ImageURL(png_data_url(gradient(64, 48, 1)))), TextPart("What?")]
        request = GenerateRequest("orphan", model_spec.served_name, [ChatMessage("user", content)], SamplingParams(4))
        processed = Processor(load_traits(model_spec), mode="e-p-d").process(request)
        gone = TensorRef("nixl", "prefill-vanished", "k1", 64, [TensorSpec("float32", [16])], time.time() + 60)
        orphan = msgspec.structs.replace(
            processed.without_inline_media(),
            bridge_restarts=True,
            hop_index=2,
            kv=KvHandoff(gone, prompt_len=100, output_ids=[5]),
        )
        js = stack.nc.jetstream()
        await (await js.key_value(agent_bucket(config.namespace))).put("prefill-vanished", b"metadata")
        replies = await stack.nc.subscribe(config.subjects.reply("orphan"))
        await js.publish(config.subjects.work("decode"), encode(orphan))
        chunk = msgspec.msgpack.decode((await replies.next_msg(timeout=30)).data)
        assert chunk["code"] == "internal_error" and "bridge holding the request's media is gone" in chunk["message"]
        assert next(w for w in stack.workers if w.role == "encode").handled == 0  # nothing restarted
    finally:
        await stop()
