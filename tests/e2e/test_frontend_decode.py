"""--frontend-decode: the bridge (or a processor worker) fetches and decodes
a request's media and the encoding worker reads the pixels, frames and
samples by the tensor transport (real NIXL), decoding nothing itself. The
tokens stay generate()'s; a worker that cannot read them, or media gone
before they were read, fall back to the request as it arrived. A real
nats-server per test, the official client."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import openai
import pytest

from pipeline.config import PipelineConfig
from schemas.processed import MediaKind, ProcessedRequest
from schemas.request import AudioPart, ImagePart, InputAudioPart, VideoPart
from schemas.routes import MODES
from stages.models import ModelSpec, resolve_model
from tests.e2e.conftest import N, Stack, ask, client, gradient, png_data_url, start_stack
from tests.e2e.test_families_av import Reference, _two_audios, _video_then_image
from tests.polling import eventually


def _config(pipeline_config: PipelineConfig, mode: str) -> PipelineConfig:
    return dataclasses.replace(pipeline_config, mode=mode)


async def _first_hop_messages(stack: Stack) -> asyncio.Queue[ProcessedRequest]:
    """A copy of every message published to the first hop's queue (a core subscriber)."""
    seen: asyncio.Queue[ProcessedRequest] = asyncio.Queue()

    async def copy(msg: Any) -> None:
        await seen.put(msgspec.msgpack.decode(msg.data, type=ProcessedRequest))

    await stack.nc.subscribe(stack.config.subjects.work(MODES[stack.config.mode][0]), cb=copy)
    return seen


def _inline(message: ProcessedRequest) -> list[str]:
    """The inline media data the message carries, part by part."""
    out = []
    for item in message.media:
        message_index, at = item.part
        content = message.request.messages[message_index].content
        assert not isinstance(content, str)
        part = content[at]
        if isinstance(part, ImagePart):
            out.append(part.image_url.url)
        elif isinstance(part, VideoPart):
            out.append(part.video_url.url)
        elif isinstance(part, InputAudioPart):
            out.append(part.input_audio.data)
        else:
            assert isinstance(part, AudioPart)
            out.append(part.audio_url.url)
    return out


def _encoder(stack: Stack) -> Any:
    return next(w for w in stack.workers if "encode" in w.role.split("+"))


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("name", "make", "mode"),
    [
        ("tiny-qwen2.5-vl", _video_then_image, "epd"),
        ("tiny-qwen2.5-vl", _video_then_image, "e-pd"),
        ("tiny-qwen2-audio", _two_audios, "e-pd"),
    ],
)
async def test_media_decoded_by_the_bridge_give_generates_tokens(
    pipeline_config: PipelineConfig,
    mmpipe_home: Path,
    name: str,
    make: Callable[[], tuple[list[dict[str, Any]], list[Any]]],
    mode: str,
) -> None:
    reference = Reference(name)
    stack, stop = await start_stack(
        _config(pipeline_config, mode),
        resolve_model(name),
        modalities="image,video,audio",
        bridge_processes=True,
        frontend_decode=True,
    )
    try:
        seen = await _first_hop_messages(stack)
        content, sources = make()
        expected = reference(content, sources)
        async with client(stack) as c:
            assert await ask(c, content, stream=True, model=name) == (expected, N)
        message = await asyncio.wait_for(seen.get(), 10)
        # What the encoder got: the decoded media's ref, and no bytes to decode itself.
        assert message.decoded is not None and message.media_dropped
        assert [i.kind for i in message.decoded.items] == [m.kind for m in message.media]
        assert all(i.digest for i in message.decoded.items)
        assert _inline(message) == [""] * len(message.media)
        kinds = {i.kind for i in message.decoded.items}
        if MediaKind.VIDEO in kinds:
            video = next(i for i in message.decoded.items if i.kind is MediaKind.VIDEO)
            assert len(video.timestamps) == message.decoded.ref.tensors[0].shape[0] > 0
        if MediaKind.AUDIO in kinds:
            assert all(i.sampling_rate == 16_000 for i in message.decoded.items)
        # The bridge holds nothing once the encoder has read it.
        assert stack.bridge.tensors is not None
        await eventually(lambda: stack.bridge.tensors.held_bytes == 0, within=10)
        # The same media again: the encoder's embedding cache (or its prefix
        # cache) by the digests the bridge sent, with the same answer.
        async with client(stack) as c:
            assert await ask(c, content, stream=False, model=name) == (expected, N)
        await eventually(lambda: stack.bridge.tensors.held_bytes == 0, within=10)
    finally:
        await stop()


@pytest.mark.e2e
async def test_a_processor_worker_decodes_and_keeps_the_inline_media(
    pipeline_config: PipelineConfig, model_spec: ModelSpec, reference: Any
) -> None:
    """Without the bridge processing, the processor worker decodes; its
    message keeps the inline image (it holds no request to restart from)."""
    stack, stop = await start_stack(_config(pipeline_config, "e-pd"), model_spec, frontend_decode=True)
    try:
        seen = await _first_hop_messages(stack)
        image = gradient(64, 48, 2)
        url = png_data_url(image)
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What?"}]
        async with client(stack) as c:
            assert await ask(c, content, stream=True) == (reference(content, [image], N)[1], N)
        message = await asyncio.wait_for(seen.get(), 10)
        assert message.decoded is not None and not message.media_dropped
        assert _inline(message) == [url]
        [spec] = message.decoded.ref.tensors
        assert (spec.dtype, spec.shape) == ("uint8", [48, 64, 3])
    finally:
        await stop()


@pytest.mark.e2e
async def test_a_worker_without_the_flag_gets_the_request_as_it_arrived(
    pipeline_config: PipelineConfig, model_spec: ModelSpec, reference: Any
) -> None:
    """The bridge decodes, the EPD worker opened no reader (a split mode's
    encoder has one anyway, for its hand-off): it asks the bridge for the
    request again and decodes the image itself."""
    stack, stop = await start_stack(
        _config(pipeline_config, "epd"), model_spec, bridge_processes=True, frontend_decode=(True, False)
    )
    try:
        seen = await _first_hop_messages(stack)
        image = gradient(56, 40, 3)
        content = [{"type": "image_url", "image_url": {"url": png_data_url(image)}}, {"type": "text", "text": "Hm?"}]
        async with client(stack) as c:
            assert await ask(c, content, stream=False) == (reference(content, [image], N)[1], N)
        first, again = await asyncio.wait_for(seen.get(), 10), await asyncio.wait_for(seen.get(), 10)
        assert first.decoded is not None and first.attempt == 0
        assert again.decoded is None and again.attempt == 1 and _inline(again)[0]
        assert _encoder(stack).handled == 2
        # What the first attempt held is freed with the request, not at its TTL.
        assert stack.bridge.tensors is not None
        await eventually(lambda: stack.bridge.tensors.held_bytes == 0, within=10)
    finally:
        await stop()


@pytest.mark.e2e
async def test_decoded_media_gone_before_the_encoder_read_them_restart_at_the_bridge(
    pipeline_config: PipelineConfig, model_spec: ModelSpec, reference: Any
) -> None:
    """What the bridge decoded expires before the encoder reads it (a TTL
    of a millisecond): the bridge queues the request as it arrived again,
    and the encoder decodes the image itself."""
    stack, stop = await start_stack(
        _config(pipeline_config, "e-pd"),
        model_spec,
        bridge_processes=True,
        frontend_decode=True,
        bridge_tensor_ttl_s=1e-3,
    )
    try:
        seen = await _first_hop_messages(stack)
        image = gradient(48, 64, 4)
        content = [{"type": "image_url", "image_url": {"url": png_data_url(image)}}, {"type": "text", "text": "So?"}]
        async with client(stack) as c:
            assert await ask(c, content, stream=True) == (reference(content, [image], N)[1], N)
        first, again = await asyncio.wait_for(seen.get(), 10), await asyncio.wait_for(seen.get(), 10)
        assert first.decoded is not None and first.attempt == 0
        assert again.attempt == 1 and again.decoded is None and _inline(again)[0]
        assert _encoder(stack).handled == 2
    finally:
        await stop()


@pytest.mark.e2e
async def test_media_that_do_not_decode_are_answered_by_the_bridge(
    pipeline_config: PipelineConfig, model_spec: ModelSpec
) -> None:
    stack, stop = await start_stack(
        _config(pipeline_config, "e-pd"), model_spec, bridge_processes=True, frontend_decode=True
    )
    try:
        buf = io.BytesIO()
        gradient(32, 32, 1).save(buf, format="PNG")
        broken = "data:image/png;base64," + base64.b64encode(buf.getvalue()[:60]).decode()
        content = [{"type": "image_url", "image_url": {"url": broken}}, {"type": "text", "text": "?"}]
        async with client(stack) as c:
            with pytest.raises(openai.APIStatusError) as raised:
                await ask(c, content, stream=False)
            assert (raised.value.status_code, raised.value.body["code"]) == (400, "invalid_media")  # type: ignore[index]
            # Nothing was queued, and the stack serves on.
            assert all(w.handled == 0 for w in stack.workers)
            _, usage = await ask(c, "Say something.", stream=False)
        assert usage == N
        assert stack.bridge.tensors is not None and stack.bridge.tensors.held_bytes == 0
    finally:
        await stop()


def test_the_frontend_flag_refuses_the_engine_process(pipeline_config: PipelineConfig, model_spec: ModelSpec) -> None:
    from pipeline.serve import WorkerSettings, build_stage
    from stages.media import MediaPolicy

    settings = WorkerSettings(media=MediaPolicy(frontend_decode=True), engine_process=True)
    with pytest.raises(SystemExit, match="frontend-decode"):
        build_stage("encode+prefill+decode", pipeline_config, settings, model_spec)
