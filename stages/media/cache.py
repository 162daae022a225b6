"""An LRU of encoder outputs keyed by media content, so a repeated image or clip skips the encoder.

The key is a hash of the media *bytes* plus everything else that changes the embedding (the
model, the kind of media, the preprocessing options), never the URL: one image reached by two
URLs (a CDN link and a data: URL) is one entry, and one URL whose content changed is not a
stale hit. Capacity is in bytes of tensor data (``--embedding-cache-bytes``), since the entries
differ in size by orders of magnitude (a thumbnail's few tokens, a video's thousands).

Where it lives: with the role that runs the vision/audio encoder (the encode worker in E/PD and
E/P/D, the single worker otherwise). A hit there skips the encoder and hands the cached tensor
on like a fresh one.

Model-agnostic: it stores a tensor and the grid the family needs to place it, nothing about
any model. torch is imported lazily, so importing ``stages.media`` (the bridge does, for the
policy) does not pull torch in.

Thread-safety: none. It is meant to be called from the worker's asyncio event loop only; no
method awaits, so each call is atomic with respect to other tasks on that loop. Calling it from
encoder threads as well would need a lock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

from prometheus_client import Counter, Gauge

from schemas.processed import MediaItem
from stages.media.lru import ByteLRU

if TYPE_CHECKING:
    import torch

HITS: Final = Counter("mmpipe_embedding_cache_hits_total", "Embedding cache lookups that found an entry", ["name"])
MISSES: Final = Counter("mmpipe_embedding_cache_misses_total", "Embedding cache lookups that found none", ["name"])
EVICTIONS: Final = Counter(
    "mmpipe_embedding_cache_evictions_total", "Embedding cache entries evicted to make room", ["name"]
)
REFUSED: Final = Counter(
    "mmpipe_embedding_cache_refused_total", "Embeddings not cached: larger than the whole cache", ["name"]
)
BYTES: Final = Gauge("mmpipe_embedding_cache_bytes", "Tensor bytes held by the embedding cache", ["name"])
ENTRIES: Final = Gauge("mmpipe_embedding_cache_entries", "Entries held by the embedding cache", ["name"])

# Ties keys to this key layout: a change to it changes every key rather than reusing old ones.
_LAYOUT: Final = b"mmpipe-media-key2\0"


def content_key(data: bytes, *, model: str, kind: str, options: str = "") -> str:
    """The cache key of ``data`` encoded by ``model`` as ``kind`` media with ``options``.

    SHA-256 of the bytes and of what else changes the embedding: ``model`` (checkpoint path
    or name; fold in anything else that changes the output, such as the encoder dtype), ``kind``
    ("image", "video", "audio") and ``options``, the preprocessing in a canonical text form
    (e.g. video fps/num_frames, image min/max pixels): the same clip sampled at 1 fps and at
    2 fps gives different embeddings and must not share an entry. Each field is length-prefixed,
    so no two different field tuples hash the same input.

    SHA-256, not BLAKE2b: the CPUs that serve (x86 since Zen and Ice Lake, Arm v8 with its
    crypto extensions) hash it in hardware, 1.8 GB/s against BLAKE2b's 0.95 on a 603 KB PNG
    (2-vCPU AMD EPYC). hashlib releases the GIL for large inputs: hash a video in a thread
    (``asyncio.to_thread``), not on the event loop.
    """
    h = hashlib.sha256(_LAYOUT)
    for field in (model, kind, options):
        raw = field.encode()
        h.update(len(raw).to_bytes(8, "little"))
        h.update(raw)
    h.update(len(data).to_bytes(8, "little"))
    h.update(data)
    return h.hexdigest()


def item_digest(item: MediaItem, data: bytes) -> str:
    """A media item's content digest: its bytes, and how they are read
    (its kind, a video's sampling, an audio's declared format, embeddings
    sent as such). The prefix cache keys the KV blocks showing the item by
    it, and a cache-aware router the prompts it routes."""
    options = json.dumps([item.num_frames, item.fps, item.max_frames, item.format, item.embeds])
    return content_key(data, model="", kind=item.kind.value, options=options)


# Hashing runs at 1 to 2 GB/s and hashlib lets go of the GIL: beyond this much
# (about a thread hop's cost), hash off the event loop. A 448×448 PNG hashed on
# the loop, twice, was 17% of a worker loop's CPU under 64 clients (H100 host).
_THREAD_HASH_BYTES = 64 << 10


async def item_digest_off_loop(item: MediaItem, data: bytes) -> str:
    """``item_digest``, on a thread for a large item."""
    if len(data) > _THREAD_HASH_BYTES:
        return await asyncio.to_thread(item_digest, item, data)
    return item_digest(item, data)


def media_set_key(digests: list[str]) -> str:
    """A request's media, in order, by content alone (no model): what an
    encoding worker tells it holds the embeddings of, and what a router
    looks up to send the same media to it again."""
    return content_key("".join(digests).encode(), model="", kind="media")


@dataclasses.dataclass(frozen=True, eq=False)
class CachedEmbedding:
    """An encoder output as the cache holds it: the embeddings and the grid they were laid out on.

    ``embeddings`` is always stored as a CPU, contiguous copy, made here. The caller's tensor
    is usually on the GPU and about to be handed to a transport (NIXL, the object store) or
    freed; a cache entry that shared its storage would change or vanish with it, and a GPU
    entry would hold device memory the engine budgets for KV cache. Contiguous also makes
    ``nbytes`` the memory actually held, so the byte accounting is exact.

    Building one from a GPU tensor waits for the copy (a device sync): do it where the encoder
    output is synchronised anyway, not in the middle of the event loop's other work. Treat the
    stored tensor as read-only; ``.to(device)`` it for use, which copies.

    ``eq=False``: tensors have no single truth value, so entries compare by identity.
    """

    embeddings: torch.Tensor
    # The patch/frame grid the family needs to place the embeddings (e.g. Qwen2-VL's (t, h, w)).
    grid: tuple[int, ...]
    # Real-valued layout parameters beside the grid (Qwen2.5-VL: seconds per temporal grid step).
    scales: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        from stages.device_copy import to_host

        object.__setattr__(self, "embeddings", to_host(self.embeddings))
        object.__setattr__(self, "grid", tuple(int(g) for g in self.grid))

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data held (the grid's few integers are not counted)."""
        return self.embeddings.numel() * self.embeddings.element_size()


@dataclasses.dataclass(frozen=True, slots=True)
class _Series:
    """One cache's labelled metric series, made only for an enabled cache (see EmbeddingCache)."""

    hits: Counter
    evictions: Counter
    refused: Counter
    bytes: Gauge
    entries: Gauge

    @classmethod
    def of(cls, name: str) -> _Series:
        return cls(
            HITS.labels(name=name),
            EVICTIONS.labels(name=name),
            REFUSED.labels(name=name),
            BYTES.labels(name=name),
            ENTRIES.labels(name=name),
        )


class EmbeddingCache:
    """A byte-bounded LRU of CachedEmbedding by ``content_key``, with Prometheus metrics.

    ``capacity_bytes`` 0 disables it: every ``get`` is a miss and ``put`` stores nothing, so a
    deployment without a cache still reports its misses (the work a cache would save) and
    nothing else. An entry larger than the whole capacity is refused rather than evicting
    everything for something that cannot fit. ``name`` labels the metrics; give each cache in
    a process its own, since two caches under one name would overwrite each other's gauges.

    Event-loop only, no locking: see the module docstring.
    """

    def __init__(self, capacity_bytes: int, name: str = "encode") -> None:
        if capacity_bytes < 0:
            raise ValueError(f"embedding cache capacity must be >= 0 bytes, got {capacity_bytes}")
        self._name = name
        self._lru: ByteLRU[str, CachedEmbedding] = ByteLRU(
            capacity_bytes, lambda value: value.nbytes, on_evict=self._evicted
        )
        self._hits = self._misses = self._evictions = self._refused = 0
        self._m_misses = MISSES.labels(name=name)
        # labels() alone exports a series (at 0): a disabled cache makes none but its misses.
        # An enabled one makes them all now, so dashboards see an empty cache, not no cache.
        self._series = _Series.of(name) if capacity_bytes > 0 else None
        # Told of each key stored (True) and evicted (False): a worker relays it to routers.
        self.listener: Callable[[str, bool], None] | None = None
        self._update_gauges()

    @property
    def name(self) -> str:
        return self._name

    @property
    def capacity(self) -> int:
        """Capacity in bytes of tensor data; 0 when disabled."""
        return self._lru.capacity

    @property
    def bytes(self) -> int:
        """Bytes of tensor data held now; never over ``capacity``."""
        return self._lru.bytes

    @property
    def entries(self) -> int:
        return len(self._lru)

    def get(self, key: str) -> CachedEmbedding | None:
        """The entry for ``key``, made most recently used, or None; counted as a hit or a miss."""
        value = self._lru.get(key)
        if value is None or self._series is None:
            self._misses += 1
            self._m_misses.inc()
            return None
        self._hits += 1
        self._series.hits.inc()
        return value

    def put(self, key: str, value: CachedEmbedding) -> bool:
        """Store ``value`` under ``key`` as most recently used, evicting the least recent to fit.

        False, storing nothing, when disabled or when ``value`` alone is over the capacity (counted
        as refused; an entry already under ``key`` stays: the key names the content, so it holds
        the same embedding). Storing under a key already present replaces that entry.
        """
        series = self._series
        if series is None:
            return False
        if not self._lru.put(key, value):
            self._refused += 1
            series.refused.inc()
            return False
        self._update_gauges()
        if self.listener is not None:
            self.listener(key, True)
        return True

    def stats(self) -> dict[str, int]:
        """This cache's counts since it was made (the metrics add up over every cache of a name)."""
        return {
            "hits": self._hits,
            "misses": self._misses,
            "evictions": self._evictions,
            "refused": self._refused,
            "bytes": self._lru.bytes,
            "entries": len(self._lru),
        }

    def _evicted(self, key: str, value: CachedEmbedding) -> None:
        if self.listener is not None:
            self.listener(key, False)
        self._evictions += 1
        if self._series is not None:
            self._series.evictions.inc()

    def _update_gauges(self) -> None:
        if self._series is not None:
            self._series.bytes.set(self._lru.bytes)
            self._series.entries.set(len(self._lru))
