"""The decoded-media cache: media seen again (even in another set, where the
embedding cache misses) are not decoded again, and it stays in its bytes."""

from __future__ import annotations

from pathlib import Path

from PIL import Image

from stages.contract import HopContext
from stages.encoder import MediaEncoder
from stages.media import MediaFetcher, MediaPolicy
from stages.media.decoded import LOOKUPS, DecodedMediaCache, decoded_nbytes
from stages.torch_engine.engine import TorchEngine
from stages.torch_engine.scheduler import EngineThread
from tests.stages.inline_images import image_request, png


def test_lru_in_bytes() -> None:
    one, two = Image.new("RGB", (10, 10)), Image.new("RGB", (10, 10))
    cache = DecodedMediaCache(capacity_bytes=2 * decoded_nbytes(one) + 10)
    cache.put("a", one)
    cache.put("b", two)
    assert cache.get("a") is one  # a is now the most recent
    cache.put("c", Image.new("RGB", (10, 10)))
    assert cache.get("b") is None and cache.get("a") is one and cache.bytes == 2 * 300
    cache.put("huge", Image.new("RGB", (100, 100)))  # larger than the whole cache: not kept
    assert cache.get("huge") is None and len(cache) == 2


async def test_an_image_seen_again_in_another_set_is_not_decoded_again(tiny_model_dir: Path) -> None:
    policy = MediaPolicy()
    thread, fetcher = EngineThread(), MediaFetcher(policy)
    encoder = MediaEncoder(TorchEngine(tiny_model_dir), thread, fetcher, policy)
    hits = LOOKUPS.labels("hit")
    try:
        a, b = png(1), png(2)
        first = await encoder.encode(image_request(a), HopContext())
        before = hits._value.get()
        again = await encoder.encode(image_request(a, b), HopContext())  # a new set: the embedding cache misses
        assert hits._value.get() == before + 1  # a came from the decoded cache, b was decoded
        assert encoder.decoded_cache is not None and len(encoder.decoded_cache) == 2
        assert [e.grid_thw for e in again][:1] == [first[0].grid_thw]
        off = MediaEncoder(encoder.engine, thread, fetcher, MediaPolicy(decoded_cache_bytes=0))
        assert off.decoded_cache is None
        assert [e.grid_thw for e in await off.encode(image_request(a, b), HopContext())] == [e.grid_thw for e in again]
    finally:
        await fetcher.close()
        thread.close()
