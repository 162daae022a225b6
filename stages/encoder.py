"""The encode step: a request's media → embeddings, through the embedding cache.

The cache is keyed by the content of all of a request's images together (a
hash of their bytes, never their URLs), not image by image. A vision tower's
numerics depend on the batch it runs in: encoded alone, one in four Qwen-VL
test images came out different in the last bits from the same image encoded
with the others, and generate() encodes a request's images in one call. An
entry for the whole set is exactly what a fresh encode would give, so a hit
keeps mmpipe's promise of generate()'s tokens; the common case, one image
sent again, hits just the same.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import torch

from schemas.errors import UnsupportedMedia
from schemas.processed import MediaKind, ProcessedRequest
from stages.contract import HopContext
from stages.engine import EncodedImage, TorchEngine
from stages.media import (
    CachedEmbedding,
    EmbeddingCache,
    MediaFetcher,
    MediaPolicy,
    content_key,
    decode_image,
    parse_embeddings,
)
from stages.scheduler import EngineThread

# Hashing runs at about 1 GB/s: beyond this much, do it off the event loop.
_THREAD_HASH_BYTES = 4 << 20


class MediaEncoder:
    def __init__(
        self,
        engine: TorchEngine,
        thread: EngineThread,
        fetcher: MediaFetcher,
        policy: MediaPolicy,
        cache: EmbeddingCache | None = None,
    ) -> None:
        self.engine = engine
        self.thread = thread
        self.fetcher = fetcher
        self.policy = policy
        self.cache = cache
        # What else changes the embeddings of the same bytes: the weights and their dtype.
        self._model_key = f"{engine.model_dir.resolve()}:{engine.dtype}"

    async def encode(self, req: ProcessedRequest, ctx: HopContext) -> list[EncodedImage]:
        for item in req.media:
            if item.kind is not MediaKind.IMAGE:
                # The processor lets through only what the family's adapter runs.
                raise UnsupportedMedia(f"{item.kind.value} input is not supported by this worker's model")
        if not req.media:
            return []
        datas = await asyncio.gather(*(self.fetcher.fetch(m.url) for m in req.media))
        if any(m.embeds for m in req.media):
            return await self._with_precomputed(req, list(datas), ctx)
        key = await self._key(datas) if self.cache is not None else ""
        if self.cache is not None and (hit := self.cache.get(key)) is not None:
            ctx.trace["cache_hit"] = 1.0
            return _unpack(hit)
        encoded = await self._encode_pixels(list(datas), ctx)
        if self.cache is not None:
            ctx.trace["cache_hit"] = 0.0
            self.cache.put(key, _pack(encoded))
        return encoded

    async def _encode_pixels(self, datas: list[bytes], ctx: HopContext) -> list[EncodedImage]:
        images = await asyncio.gather(*(asyncio.to_thread(decode_image, d, self.policy) for d in datas))
        started = time.monotonic()
        encoded = await self.thread.call(self.engine.encode, list(images))
        ctx.trace["encode_s"] = time.monotonic() - started
        return encoded

    async def _with_precomputed(self, req: ProcessedRequest, datas: list[bytes], ctx: HopContext) -> list[EncodedImage]:
        """Images sent as embeddings skip the tower; the others still go
        through it in one call. Not cached: the client already holds them."""
        pixels = [d for d, m in zip(datas, req.media, strict=True) if not m.embeds]
        encoded = iter(await self._encode_pixels(pixels, ctx) if pixels else [])
        out: list[EncodedImage] = []
        for data, item in zip(datas, req.media, strict=True):
            if item.embeds:
                given = await asyncio.to_thread(parse_embeddings, data)
                out.append(self.engine.from_precomputed(given.embeddings, given.grid))
            else:
                out.append(next(encoded))
        return out

    async def _key(self, datas: list[bytes]) -> str:
        # Length-prefixed, so two images can never read as one, or the other way round.
        blob = b"".join(len(d).to_bytes(8, "big") + d for d in datas)
        if len(blob) > _THREAD_HASH_BYTES:
            return await asyncio.to_thread(content_key, blob, model=self._model_key, kind="image")
        return content_key(blob, model=self._model_key, kind="image")


def _pack(encoded: list[EncodedImage]) -> CachedEmbedding:
    """One entry for an image set: the embeddings end to end, and a grid of
    (count, dims, each item's grid..., each item's token count...)."""
    dims = len(encoded[0].grid_thw)
    layout = (len(encoded), dims, *itertools.chain.from_iterable(e.grid_thw for e in encoded))
    return CachedEmbedding(torch.cat([e.embeddings for e in encoded]), (*layout, *(e.num_tokens for e in encoded)))


def _unpack(cached: CachedEmbedding) -> list[EncodedImage]:
    n, dims = cached.grid[0], cached.grid[1]
    grids = [tuple(cached.grid[2 + i * dims : 2 + (i + 1) * dims]) for i in range(n)]
    counts = list(cached.grid[2 + n * dims :])
    parts = torch.split(cached.embeddings, counts)
    return [EncodedImage(p, g) for p, g in zip(parts, grids, strict=True)]
