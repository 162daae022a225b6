"""Encoder batching across requests (``--encode-batch``): requests waiting
together share one tower call, each gets its own items back in order, one
bad request does not fail the others, and at 1 nothing changes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from stages.families import Media
from stages.torch_engine.encode_batcher import EncodeBatcher
from stages.torch_engine.engine import TorchEngine
from stages.torch_engine.scheduler import EngineThread


def _image(seed: int, size: tuple[int, int] = (56, 42)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> TorchEngine:
    return TorchEngine(tiny_model_dir)


@pytest.fixture
def thread() -> Iterator[EngineThread]:
    t = EngineThread()
    yield t
    t.close()


def _close(a: list, b: list) -> None:  # type: ignore[type-arg]
    assert [e.grid_thw for e in a] == [e.grid_thw for e in b]
    for x, y in zip(a, b, strict=True):
        # The same images in a larger call: equal up to the last bits.
        torch.testing.assert_close(x.embeddings, y.embeddings, rtol=1e-4, atol=1e-5)


async def test_requests_waiting_together_share_one_call(engine: TorchEngine, thread: EngineThread) -> None:
    batcher = EncodeBatcher(engine, thread, max_items=8)
    requests: list[list[Media]] = [[_image(1)], [_image(2), _image(3, (28, 56))], [_image(4)]]
    got = await asyncio.gather(*(batcher.encode(media) for media in requests))
    assert batcher.calls == 1
    for media, encoded in zip(requests, got, strict=True):
        assert len(encoded) == len(media)
        _close(encoded, engine.encode(media))


async def test_the_cap_splits_at_whole_requests(engine: TorchEngine, thread: EngineThread) -> None:
    batcher = EncodeBatcher(engine, thread, max_items=4)
    requests: list[list[Media]] = [[_image(i), _image(i + 10)] for i in range(3)]
    got = await asyncio.gather(*(batcher.encode(media) for media in requests))
    assert batcher.calls == 2  # two requests (4 items), then the third
    for media, encoded in zip(requests, got, strict=True):
        _close(encoded, engine.encode(media))


async def test_one_at_a_time_is_the_per_request_call_exactly(engine: TorchEngine, thread: EngineThread) -> None:
    batcher = EncodeBatcher(engine, thread, max_items=1)
    requests: list[list[Media]] = [[_image(5)], [_image(6), _image(7)]]
    got = await asyncio.gather(*(batcher.encode(media) for media in requests))
    assert batcher.calls == 2
    for media, encoded in zip(requests, got, strict=True):
        for x, y in zip(encoded, engine.encode(media), strict=True):
            assert torch.equal(x.embeddings, y.embeddings)


async def test_a_bad_request_fails_alone(engine: TorchEngine, thread: EngineThread) -> None:
    from schemas.errors import UnsupportedMedia
    from stages.media.audio import DecodedAudio

    batcher = EncodeBatcher(engine, thread, max_items=8)
    audio = DecodedAudio(np.zeros(1600, dtype=np.float32), 0.1)  # Qwen2-VL takes no audio
    good = [_image(8)]
    results = await asyncio.gather(batcher.encode(good), batcher.encode([audio]), return_exceptions=True)
    assert isinstance(results[1], UnsupportedMedia)
    assert not isinstance(results[0], BaseException)
    _close(results[0], engine.encode(good))
    # The worker goes on: the next request is encoded.
    assert len(await batcher.encode([_image(9)])) == 1


async def test_a_cancelled_request_leaves_the_others(engine: TorchEngine, thread: EngineThread) -> None:
    batcher = EncodeBatcher(engine, thread, max_items=8)
    first = asyncio.create_task(batcher.encode([_image(10)]))
    doomed = asyncio.create_task(batcher.encode([_image(11)]))
    await asyncio.sleep(0)
    doomed.cancel()
    encoded = await first
    with pytest.raises(asyncio.CancelledError):
        await doomed
    _close(encoded, engine.encode([_image(10)]))


def test_at_least_one_item_per_call(engine: TorchEngine, thread: EngineThread) -> None:
    with pytest.raises(ValueError, match="at least 1 item"):
        EncodeBatcher(engine, thread, max_items=0)


def test_images_preprocessed_on_threads_equal_the_processors_batch(engine: TorchEngine) -> None:
    family: Any = engine.family
    images = [_image(20 + i, (40 + 8 * i, 60)) for i in range(4)]
    want = family.image_processor(images=images, return_tensors="pt")
    pixels, grid = family.preprocess(images)
    assert torch.equal(pixels, want["pixel_values"]) and torch.equal(grid, want["image_grid_thw"])
