"""The encode step: a request's media → embeddings, through the embedding cache.

The cache is keyed by the content of all of a request's media together (a
hash of their bytes and of how each is sampled, never their URLs), not item
by item. An encoder's numerics depend on the batch it runs in: encoded
alone, one in four Qwen-VL test images came out different in the last bits
from the same image encoded with the others, and generate() encodes a
request's images in one call. An entry for the whole set is exactly what a
fresh encode would give, so a hit keeps mmpipe's promise of generate()'s
tokens; the common case, one item sent again, hits just the same.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
from collections.abc import Awaitable, Callable
from typing import Final

import structlog
import torch
from prometheus_client import Counter

from schemas.errors import InvalidRequest, TensorGone
from schemas.processed import DecodedMedia, MediaItem, MediaKind, ProcessedRequest
from stages.contract import HopContext, TensorStore
from stages.families.base import Decoded, Media, MediaEmbedding
from stages.media import (
    CachedEmbedding,
    EmbeddingCache,
    MediaFetcher,
    MediaPolicy,
    VideoOptions,
    content_key,
    decode_audio,
    decode_image,
    decode_video,
    media_set_key,
    parse_data_url,
    parse_embeddings,
)
from stages.media.cache import item_digest_off_loop
from stages.media.decode_pool import DecodePool
from stages.media.decoded import DecodedMediaCache
from stages.media.frontend import from_tensor
from stages.media.layouts import MediaLayouts
from stages.media.lru import ByteLRU
from stages.media.video import video_options
from stages.processor import WARM_UP_IMAGE_URL
from stages.torch_engine.encode_batcher import EncodeBatcher
from stages.torch_engine.engine import TorchEngine
from stages.torch_engine.scheduler import EngineThread

log = structlog.get_logger(__name__)


SKIPPED: Final = Counter(
    "mmpipe_encoder_skipped_items_total",
    "Media items not encoded: their tokens were in the prefix the prompt found cached",
)
EARLY_DECODES: Final = Counter(
    "mmpipe_encoder_early_decodes_total",
    "Images decoded while their digest was taken (one request at a time, an image not seen before)",
)

# How many images' fingerprints a worker remembers, to tell a new image from one sent again.
_SEEN_IMAGES: Final = 4096


def _fingerprint(data: bytes) -> tuple[int, bytes, bytes]:
    """An image's size and ends: equal for the same bytes; two images that
    share them only lose the early decode."""
    return len(data), data[:64], data[-64:]


class MediaEncoder:
    def __init__(
        self,
        engine: TorchEngine,
        thread: EngineThread,
        fetcher: MediaFetcher,
        policy: MediaPolicy,
        cache: EmbeddingCache | None = None,
        tensors: TensorStore | None = None,
    ) -> None:
        self.engine = engine
        # Where media the processor decoded (--frontend-decode) are read from.
        self.tensors = tensors
        # Reads of such media no longer needed (a cache hit): done off the request's path.
        self._reads: set[asyncio.Future[list[Decoded]]] = set()
        self.thread = thread
        self.fetcher = fetcher
        self.policy = policy
        self.cache = cache
        self.decoded_cache = DecodedMediaCache(policy.decoded_cache_bytes) if policy.decoded_cache_bytes else None
        self.batcher = EncodeBatcher(engine, thread, policy.encode_batch_items)
        processes = decode_processes(policy, engine.device)
        self.decode_pool = DecodePool(processes) if processes > 0 else None
        # Host copies on their way into the cache (held so they are not collected).
        self._storing: set[asyncio.Future[CachedEmbedding]] = set()
        # What else changes the embeddings of the same bytes: the weights and their dtype.
        self._model_key = f"{engine.model_dir.resolve()}:{engine.dtype}"
        # Told which media sets' embeddings are held (True) or no longer
        # (False), by media_set_key: routers send the same media here again.
        self.on_cached: Callable[[str, bool], None] | None = None
        self._set_keys: dict[str, str] = {}
        if cache is not None:
            cache.listener = self._cached
        # Set where this role prefills too, with prefix caching: whether the
        # prefix a request's prompt finds cached holds all of these media
        # (their digests and sizes); then the tower is not run for them.
        self.prefix_probe: Callable[[ProcessedRequest, list[MediaEmbedding]], Awaitable[bool]] | None = None
        # Each digest's layout, from its last encoding here: what a stand-in needs.
        self._layouts = MediaLayouts()
        # Images seen here lately, by a fingerprint: not decoded before their digest.
        self._seen: ByteLRU[tuple[int, bytes, bytes], bool] = ByteLRU(_SEEN_IMAGES, lambda _: 1)
        # Decodes begun beside a digest and not awaited: held until they end.
        self._early: set[asyncio.Future[Decoded]] = set()

    async def encode(self, req: ProcessedRequest, ctx: HopContext, reuse_prefix: bool = True) -> list[MediaEmbedding]:
        """The request's media as embeddings. With ``reuse_prefix`` and every
        item's tokens in the prefix its prompt finds cached, stand-ins
        (``encoded=False``) instead: as vLLM skips the encoder for media its
        prefix cache covers. Only all or none: generate() encodes a request's
        items in one call, and one alone can round differently."""
        if not req.media:
            return []
        if req.decoded is not None:
            return await self._encode_decoded(req, req.decoded, ctx, reuse_prefix)
        for item in req.media:
            self._options(item)  # a bad sampling request fails before any download
        with ctx.timed("media_fetch", items=len(req.media)):
            datas = list(
                await asyncio.gather(*(self.fetcher.fetch(req.media_url(m), max_bytes=self._cap(m)) for m in req.media))
            )
        early = self._decoding_early(req.media, datas)
        try:
            # Each item's content digest: what the prefix cache keys the KV blocks
            # showing it by, and (together) the embedding cache's key.
            with ctx.timed("digest", items=len(req.media)):
                digests = list(
                    await asyncio.gather(*(item_digest_off_loop(m, d) for m, d in zip(req.media, datas, strict=True)))
                )
            if any(m.embeds for m in req.media):
                return _digested(await self._with_precomputed(req, datas, digests, ctx), digests)
            return await self._encoded(
                req, digests, lambda: self._encode_media(req.media, datas, digests, ctx, early), ctx, reuse_prefix
            )
        finally:
            for decode in early or ():
                # Awaited or not (a cache covered the media, or the request
                # failed first), it ends on its thread: its outcome read then.
                self._early.add(decode)
                decode.add_done_callback(self._early_done)

    def _decoding_early(self, items: list[MediaItem], datas: list[bytes]) -> list[asyncio.Future[Decoded]] | None:
        """One request at a time, its images are decoded on threads while
        their digests are taken, rather than after: the digest of a 448×448
        PNG was 1 to 2 ms of the first token's way on H100 hosts. Only
        images this worker has not seen (by their size and their ends): one
        seen before likely finds a cache (the prefix's, the embeddings', the
        decoded media's), where the decode would be wasted. Under load the
        decode pool keeps its order: digest, caches, then decode."""
        if any(m.kind is not MediaKind.IMAGE or m.embeds for m in items):
            return None
        # Remembered under load too: sent again once the worker is quiet, it likely hits.
        prints = [_fingerprint(d) for d in datas]
        seen = [self._seen.get(p) is not None for p in prints]
        for p in prints:
            self._seen.put(p, True)
        if any(seen) or not self.thread.quiet:
            return None
        EARLY_DECODES.inc(len(items))
        return [asyncio.ensure_future(asyncio.to_thread(self._decode, m, d)) for m, d in zip(items, datas, strict=True)]

    def _early_done(self, decode: asyncio.Future[Decoded]) -> None:
        self._early.discard(decode)
        if not decode.cancelled():
            # Where the request awaited it, its error was the request's; else nobody needed it.
            decode.exception()

    async def _encode_decoded(
        self, req: ProcessedRequest, decoded: DecodedMedia, ctx: HopContext, reuse_prefix: bool
    ) -> list[MediaEmbedding]:
        """Media the processor fetched and decoded (``--frontend-decode``):
        read from it (the read starts at once, beside the caches' lookups)
        and encoded as if decoded here."""
        if [i.kind for i in decoded.items] != [m.kind for m in req.media]:
            raise InvalidRequest("the decoded media do not match the request's media items")
        if self.tensors is None:
            # A worker started without --frontend-decode opens no reader: the
            # request again as it arrived, which this worker decodes itself.
            raise TensorGone("this worker reads no media decoded by the processor (start it with --frontend-decode)")
        read = asyncio.ensure_future(self._read(decoded, ctx))

        async def run() -> list[MediaEmbedding]:
            return await self._encode_prepared(await read, ctx)

        try:
            return await self._encoded(req, [i.digest for i in decoded.items], run, ctx, reuse_prefix)
        finally:
            if not read.done():
                # Not needed (a cache hit), but read all the same: a read frees the processor's copy.
                self._reads.add(read)
                read.add_done_callback(_read_done(self._reads))

    async def _read(self, decoded: DecodedMedia, ctx: HopContext) -> list[Decoded]:
        assert self.tensors is not None
        with ctx.timed("media_get", items=len(decoded.items)):
            tensors = await self.tensors.get(decoded.ref)
        if len(tensors) != len(decoded.items):
            raise InvalidRequest(f"{len(tensors)} decoded tensors for {len(decoded.items)} media items")
        return [from_tensor(item, t) for item, t in zip(decoded.items, tensors, strict=True)]

    async def _encoded(
        self,
        req: ProcessedRequest,
        digests: list[str],
        run: Callable[[], Awaitable[list[MediaEmbedding]]],
        ctx: HopContext,
        reuse_prefix: bool,
    ) -> list[MediaEmbedding]:
        """The media by their digests: stand-ins where the cached prefix
        holds them, the embedding cache's entry, or ``run``'s encoding."""
        if reuse_prefix and (stand_ins := await self._prefix_covers(req, digests)) is not None:
            ctx.trace["encode_skipped"] = float(len(stand_ins))
            SKIPPED.inc(len(stand_ins))
            return stand_ins
        key = self._key(digests) if self.cache is not None else ""
        if self.cache is not None and (hit := self.cache.get(key)) is not None:
            ctx.trace["cache_hit"] = 1.0
            return self._remember(_digested(_unpack(hit, [m.kind for m in req.media]), digests))
        encoded = await run()
        if self.cache is not None:
            ctx.trace["cache_hit"] = 0.0
            self._set_keys[key] = media_set_key(digests)
            self._store(key, encoded)
        return self._remember(_digested(encoded, digests))

    async def _prefix_covers(self, req: ProcessedRequest, digests: list[str]) -> list[MediaEmbedding] | None:
        """Stand-ins for the request's media where the cached prefix holds them all."""
        if self.prefix_probe is None:
            return None
        engine = self.engine
        stand_ins = self._layouts.stand_ins(digests, engine.family.hidden_size, engine.dtype, engine.device)
        return stand_ins if stand_ins is not None and await self.prefix_probe(req, stand_ins) else None

    def _remember(self, encoded: list[MediaEmbedding]) -> list[MediaEmbedding]:
        if self.prefix_probe is not None:
            self._layouts.remember(encoded)
        return encoded

    def _store(self, key: str, encoded: list[MediaEmbedding]) -> None:
        """Keep the embeddings in the cache, off the request's path: the
        entry is a host copy, which waits for the tower to finish on a GPU;
        on a thread, the prefill is queued behind the tower meanwhile."""
        cache = self.cache
        assert cache is not None
        if not any(e.embeddings.is_cuda for e in encoded):
            cache.put(key, _pack(encoded))
            return
        task = asyncio.ensure_future(asyncio.to_thread(_pack, encoded))

        def stored(done: asyncio.Future[CachedEmbedding]) -> None:
            self._storing.discard(done)
            if done.cancelled():
                return
            if (exc := done.exception()) is not None:
                log.warning("embedding_cache_store_failed", error=repr(exc))
                return
            cache.put(key, done.result())

        self._storing.add(task)
        task.add_done_callback(stored)

    def _cap(self, item: MediaItem) -> int:
        return self.policy.max_bytes_of(item.kind)

    def _options(self, item: MediaItem) -> VideoOptions | None:
        return video_options(item, self.engine.family.video_frame_multiple)

    def _decode(self, item: MediaItem, data: bytes) -> Decoded:
        if item.kind is MediaKind.VIDEO:
            return decode_video(data, self.policy, self._options(item))
        if item.kind is MediaKind.AUDIO:
            return decode_audio(data, self.policy, item.format or None)
        return decode_image(data, self.policy)

    async def _decoded(
        self, item: MediaItem, data: bytes, digest: str, early: asyncio.Future[Decoded] | None = None
    ) -> Decoded:
        """The item decoded (``early``: its decode already under way), from
        the decoded-media cache when these bytes were read this way before."""

        async def decode() -> Decoded:
            if early is not None:
                return await asyncio.shield(early)
            return await self._decode_off_loop(item, data)

        if self.decoded_cache is None:
            return await decode()
        return await self.decoded_cache.get_or_decode(digest, decode)

    async def _decode_off_loop(self, item: MediaItem, data: bytes) -> Decoded:
        if self.decode_pool is None or self.thread.quiet:
            # The pool keeps the GIL for the engine's thread under load; with
            # nothing on that thread (one request at a time) a thread here
            # decodes without the pool's round trip, which pickles the bytes
            # there and the pixels back: 10 ms against about 4 for a 448x448
            # PNG on an H200 host, on every request's way to its first token.
            return await asyncio.to_thread(self._decode, item, data)
        return await self.decode_pool.decode(item.kind, data, self.policy, self._options(item), item.format or None)

    async def warm_up(self) -> None:
        """Both ways a request's image is decoded, once: on a thread here
        (PIL's PNG plugin loaded) and in every process of the pool (spawned,
        their imports done)."""
        data = parse_data_url(WARM_UP_IMAGE_URL, len(WARM_UP_IMAGE_URL)).data
        await asyncio.to_thread(decode_image, data, self.policy)
        if self.decode_pool is not None:
            await self.decode_pool.warm(data, self.policy)

    def close(self) -> None:
        if self.decode_pool is not None:
            self.decode_pool.close()

    async def _encode_media(
        self,
        items: list[MediaItem],
        datas: list[bytes],
        digests: list[str],
        ctx: HopContext,
        early: list[asyncio.Future[Decoded]] | None = None,
    ) -> list[MediaEmbedding]:
        started: list[asyncio.Future[Decoded] | None] = list(early) if early is not None else [None] * len(items)
        with ctx.timed("media_decode", items=len(items)):
            decoded = await asyncio.gather(
                *(self._decoded(m, d, g, e) for m, d, g, e in zip(items, datas, digests, started, strict=True))
            )
        return await self._encode_prepared(list(decoded), ctx)

    async def _encode_prepared(self, decoded: list[Decoded], ctx: HopContext) -> list[MediaEmbedding]:
        prepared: list[Media] = list(decoded)
        if self.engine.device.type == "cuda":
            # The processor's CPU work on a thread of its own: the engine's
            # thread feeds the GPU (every running sequence's steps) and runs
            # only the tower. Not on a CPU, where the engine's thread is the
            # compute itself and a second one only competes with it (2 vCPUs,
            # tiny model: 12.7 against 10.8 req/s at 8 clients).
            with ctx.timed("preprocess", items=len(decoded)):
                prepared = await asyncio.to_thread(self.engine.prepare, prepared)
        with ctx.timed("encode", items=len(decoded)):
            return await self.batcher.encode(prepared)

    async def _with_precomputed(
        self, req: ProcessedRequest, datas: list[bytes], digests: list[str], ctx: HopContext
    ) -> list[MediaEmbedding]:
        """Images sent as embeddings skip the tower; the other items still go
        through it in one call. Not cached: the client already holds them."""
        others = [(m, d, g) for m, d, g in zip(req.media, datas, digests, strict=True) if not m.embeds]
        encoded = iter(
            await self._encode_media([m for m, _, _ in others], [d for _, d, _ in others], [g for *_, g in others], ctx)
            if others
            else []
        )
        out: list[MediaEmbedding] = []
        for data, item in zip(datas, req.media, strict=True):
            if item.embeds:
                given = await asyncio.to_thread(parse_embeddings, data)
                out.append(self.engine.from_precomputed(given.embeddings, given.grid))
            else:
                out.append(next(encoded))
        return out

    def _key(self, digests: list[str]) -> str:
        """The embedding cache's key of a request's media: their digests (each
        of fixed length) in order, and this engine's weights."""
        return content_key("".join(digests).encode(), model=self._model_key, kind="media")

    def _cached(self, key: str, stored: bool) -> None:
        set_key = self._set_keys.get(key) if stored else self._set_keys.pop(key, None)
        if set_key is not None and self.on_cached is not None:
            self.on_cached(set_key, stored)


def decode_processes(policy: MediaPolicy, device: torch.device) -> int:
    """``--media-processes``, or what it means unset: a GPU worker decodes in
    processes (its engine thread needs the GIL between launches); a CPU one
    in threads (its engine thread is the compute and holds no GIL in it)."""
    if policy.decode_processes is not None:
        return policy.decode_processes
    if device.type != "cuda":
        return 0
    return min(4, max(1, (os.cpu_count() or 1) // 4))


def _read_done(reads: set[asyncio.Future[list[Decoded]]]) -> Callable[[asyncio.Future[list[Decoded]]], None]:
    def done(read: asyncio.Future[list[Decoded]]) -> None:
        reads.discard(read)
        if not read.cancelled() and (exc := read.exception()) is not None:
            log.info("unneeded_media_read_failed", error=repr(exc))

    return done


def _digested(encoded: list[MediaEmbedding], digests: list[str]) -> list[MediaEmbedding]:
    return [dataclasses.replace(e, digest=d) for e, d in zip(encoded, digests, strict=True)]


def _pack(encoded: list[MediaEmbedding]) -> CachedEmbedding:
    """One entry for a request's media: the embeddings end to end, a grid of
    (count, dims, each item's grid..., each item's token count...) and each
    item's seconds per grid step."""
    dims = len(encoded[0].grid_thw)
    layout = (len(encoded), dims, *itertools.chain.from_iterable(e.grid_thw for e in encoded))
    return CachedEmbedding(
        torch.cat([e.embeddings for e in encoded]),
        (*layout, *(e.num_tokens for e in encoded)),
        tuple(e.seconds_per_grid for e in encoded),
    )


def _unpack(cached: CachedEmbedding, kinds: list[MediaKind]) -> list[MediaEmbedding]:
    n, dims = cached.grid[0], cached.grid[1]
    grids = [tuple(cached.grid[2 + i * dims : 2 + (i + 1) * dims]) for i in range(n)]
    counts = list(cached.grid[2 + n * dims :])
    parts = torch.split(cached.embeddings, counts)
    return [MediaEmbedding(p, g, k, s) for p, g, k, s in zip(parts, grids, kinds, cached.scales, strict=True)]
