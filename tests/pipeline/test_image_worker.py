"""The image-generation stage behind the worker runtime, against a real
nats-server: a hop queued on ``generate-image`` streams its images back on
the request's reply subject, whole and in order; a bad one is refused with
a 400 and the worker goes on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pipeline.config import PipelineConfig
from pipeline.replies import CHUNK_DECODER, ExactlyOnceRelay, is_final
from pipeline.serve import WorkerSettings, build_stage
from schemas.chunk import ErrorChunk, ImageChunk, ReplyChunk
from schemas.codec import CONTENT_TYPE, MSGPACK, encode
from schemas.errors import ErrorCode
from schemas.processed import ProcessedRequest
from schemas.request import GenerateRequest, ImageParams
from schemas.routes import GENERATE_IMAGE
from stages.image_engine.checkpoint import TINY_TEXT_TO_IMAGE, image_model_path
from tests.pipeline.test_worker import running  # noqa: F401  (the fixture)
from tests.stages.test_image_stage import _decoded, _reference


async def _queue(js: Any, config: PipelineConfig, rid: str, params: ImageParams, seed: int) -> None:
    asked = GenerateRequest(rid, TINY_TEXT_TO_IMAGE, [], image=params)
    hop = ProcessedRequest(asked, [], [], [GENERATE_IMAGE], max_tokens=0, seed=seed)
    headers = {CONTENT_TYPE: MSGPACK, "Nats-Msg-Id": f"{rid}:0:0"}
    await js.publish(config.subjects.work(GENERATE_IMAGE), encode(hop), headers=headers)


async def _reply(sub: Any) -> list[ReplyChunk]:
    chunks: list[ReplyChunk] = []
    relay = ExactlyOnceRelay()
    while not relay.done:
        msg = await sub.next_msg(timeout=60)
        chunk = relay.accept(CHUNK_DECODER.decode(msg.data, msg.headers.get(CONTENT_TYPE)))
        if chunk is not None:
            chunks.append(chunk)
    assert is_final(chunks[-1])
    return chunks


async def test_a_worker_draws_a_queued_hops_images_onto_its_reply_subject(
    running: Any,  # noqa: F811
    pipeline_config: PipelineConfig,
    mmpipe_home: Path,
) -> None:
    stage = build_stage(GENERATE_IMAGE, pipeline_config, WorkerSettings(device="cpu"))
    assert stage.models == [TINY_TEXT_TO_IMAGE]
    await running(stage)
    subjects = pipeline_config.subjects
    params = ImageParams(prompt="a green tree", n=2, width=64, height=64, steps=2, guidance=5.0)
    sub = await running.nc.subscribe(subjects.reply("draw-1"))
    await _queue(running.js, pipeline_config, "draw-1", params, seed=9)
    chunks = await _reply(sub)
    assert all(isinstance(c, ImageChunk) for c in chunks)
    images = [c for c in chunks if isinstance(c, ImageChunk)]
    assert [(c.index, c.count, c.seed) for c in images] == [(0, 2, 9), (1, 2, 9)]
    assert [_decoded(c.data) for c in images] == _reference(image_model_path(TINY_TEXT_TO_IMAGE), params, 9)

    bad = await running.nc.subscribe(subjects.reply("draw-2"))
    await _queue(running.js, pipeline_config, "draw-2", ImageParams(prompt="x", width=63), seed=1)
    [refused] = await _reply(bad)
    assert isinstance(refused, ErrorChunk) and refused.http_status == 400 and "width 63" in refused.message

    again = await running.nc.subscribe(subjects.reply("draw-3"))
    await _queue(running.js, pipeline_config, "draw-3", ImageParams(prompt="still here", steps=2), seed=2)
    [one] = await _reply(again)
    assert isinstance(one, ImageChunk) and one.count == 1


def test_a_relay_passes_each_image_once_and_ends_with_the_last() -> None:
    """A takeover draws a request's images again: the relay passes each
    index once, is done once every one of them came, and an error ends it."""
    relay = ExactlyOnceRelay()
    first, second = (ImageChunk("r", i, 2, bytes([i])) for i in (0, 1))
    assert relay.accept(first) is first and not relay.done
    assert relay.accept(ImageChunk("r", 0, 2, b"redrawn")) is None  # index 0 again: a repeat
    assert relay.accept(second) is second and relay.done and is_final(second) and not is_final(first)
    assert relay.accept(ImageChunk("r", 1, 2, b"late")) is None
    broken = ExactlyOnceRelay()
    assert isinstance(broken.accept(ErrorChunk("r", ErrorCode.INTERNAL, "x", 500)), ErrorChunk) and broken.done


def test_an_inline_limit_over_a_mebibyte_is_refused() -> None:
    with pytest.raises(ValueError, match="image-inline-bytes must be 0 to 1048576"):
        WorkerSettings(image_inline_bytes=(1 << 20) + 1)
