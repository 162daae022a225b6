"""An image new to a quiet encoder is decoded while its digest is taken:
the same embeddings as decoded after it, not for an image seen before, and
a decode no cache left a use for ends off the request's way."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from schemas.errors import InvalidMedia
from stages.contract import HopContext
from stages.encoder import EARLY_DECODES, MediaEncoder
from stages.media import EmbeddingCache, MediaFetcher, MediaPolicy
from stages.torch_engine.engine import TorchEngine
from stages.torch_engine.scheduler import EngineThread
from tests.polling import eventually
from tests.stages.inline_images import image_request, png


def _early() -> float:
    return EARLY_DECODES._value.get()


async def _until_settled(encoder: MediaEncoder) -> None:
    await eventually(lambda: not encoder._early, within=10.0)


@pytest.fixture
async def parts(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    policy = MediaPolicy(decoded_cache_bytes=0)
    thread, fetcher = EngineThread(), MediaFetcher(policy)
    try:
        yield TorchEngine(tiny_model_dir), thread, fetcher, policy
    finally:
        await fetcher.close()
        thread.close()


async def test_a_new_image_decoded_beside_its_digest_encodes_as_one_decoded_after_it(parts) -> None:  # type: ignore[no-untyped-def]
    engine, thread, fetcher, policy = parts
    encoder = MediaEncoder(engine, thread, fetcher, policy)  # no embedding cache, no decoded cache
    image = png(1)
    before = _early()
    [early] = await encoder.encode(image_request(image), HopContext())
    assert _early() == before + 1
    # Seen now: the same bytes again are digested first and decoded after.
    [after] = await encoder.encode(image_request(image), HopContext())
    assert _early() == before + 1
    assert early.grid_thw == after.grid_thw
    assert torch.equal(early.embeddings, after.embeddings)
    await _until_settled(encoder)


async def test_images_are_not_decoded_early_while_the_engine_has_work_but_are_remembered(parts) -> None:  # type: ignore[no-untyped-def]
    engine, thread, fetcher, policy = parts
    encoder = MediaEncoder(engine, thread, fetcher, policy)
    release = asyncio.Event()
    loop = asyncio.get_running_loop()
    # A call holding the engine's thread: not quiet.
    busy = asyncio.ensure_future(thread.call(lambda: asyncio.run_coroutine_threadsafe(release.wait(), loop).result()))
    try:
        await asyncio.sleep(0.05)
        assert not thread.quiet
        before = _early()
        assert encoder._decoding_early(image_request(png(2)).media, [png(2)]) is None
        assert _early() == before
    finally:
        release.set()
        await busy
    assert thread.quiet
    # Seen while the engine was busy: sent again, it waits for its digest.
    assert encoder._decoding_early(image_request(png(2)).media, [png(2)]) is None
    decodes = encoder._decoding_early(image_request(png(5)).media, [png(5)])  # new, and quiet
    assert decodes is not None
    await asyncio.gather(*decodes)


async def test_an_early_decode_a_cache_left_unused_ends_off_the_requests_way(parts) -> None:  # type: ignore[no-untyped-def]
    engine, thread, fetcher, policy = parts
    cache = EmbeddingCache(64 << 20, "early-decode-test")
    first = MediaEncoder(engine, thread, fetcher, policy, cache=cache)
    image = png(3)
    [encoded] = await first.encode(image_request(image), HopContext())
    # Another worker's encoder (its own fingerprints) on the same cache: the
    # image is new to it, so decoded early, and then found in the cache.
    second = MediaEncoder(engine, thread, fetcher, policy, cache=cache)
    before = _early()
    ctx = HopContext()
    [hit] = await second.encode(image_request(image), ctx)
    assert _early() == before + 1 and ctx.trace["cache_hit"] == 1.0
    assert torch.equal(hit.embeddings, encoded.embeddings)
    await _until_settled(second)


async def test_bytes_that_are_no_image_fail_as_invalid_media_when_decoded_early(parts) -> None:  # type: ignore[no-untyped-def]
    engine, thread, fetcher, policy = parts
    encoder = MediaEncoder(engine, thread, fetcher, policy)
    broken = png(4)[:200]  # a PNG's header, its data cut short
    before = _early()
    with pytest.raises(InvalidMedia):
        await encoder.encode(image_request(broken), HopContext())
    assert _early() == before + 1
    await _until_settled(encoder)
