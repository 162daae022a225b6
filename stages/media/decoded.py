"""An LRU of decoded media (images, sampled videos, decoded audio) by content.

The embedding cache keys a request's whole media set; an item that comes
back in another set, or with another model, misses it and would be decoded
again: decoding a video (demux, seek, convert frames) or an MP3 costs more
than hashing its bytes. Keyed like the embedding cache, by the bytes and how
they are read (kind, a video's sampling, an audio's declared format), never
the URL; bounded in bytes of decoded pixels and samples. Entries are treated
as read-only (the families' processors copy what they change).

Event-loop only, like the embedding cache.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Final

from PIL import Image
from prometheus_client import Counter

from stages.media.audio import DecodedAudio
from stages.media.lru import ByteLRU
from stages.media.video import DecodedVideo

Decoded = Image.Image | DecodedVideo | DecodedAudio

LOOKUPS: Final = Counter(
    "mmpipe_decoded_media_cache_lookups_total", "Decoded-media cache lookups, by result", ["result"]
)


def decoded_nbytes(media: Decoded) -> int:
    if isinstance(media, DecodedVideo):
        return sum(decoded_nbytes(frame) for frame in media.frames)
    if isinstance(media, DecodedAudio):
        return int(media.samples.nbytes)
    return media.width * media.height * len(media.getbands())


class DecodedMediaCache:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"decoded media cache capacity must be >= 0 bytes, got {capacity_bytes}")
        self._lru: ByteLRU[str, Decoded] = ByteLRU(capacity_bytes, decoded_nbytes)

    @property
    def capacity(self) -> int:
        return self._lru.capacity

    @property
    def bytes(self) -> int:
        return self._lru.bytes

    def __len__(self) -> int:
        return len(self._lru)

    def get(self, key: str) -> Decoded | None:
        media = self._lru.get(key)
        LOOKUPS.labels("hit" if media is not None else "miss").inc()
        return media

    def put(self, key: str, media: Decoded) -> None:
        # The key names the content and how it was read: one already held is the same media.
        if key not in self._lru:
            self._lru.put(key, media)

    async def get_or_decode(self, digest: str, decode: Callable[[], Awaitable[Decoded]]) -> Decoded:
        """The item whose ``item_digest`` this is as it was decoded before,
        or ``decode()``'s, kept. The digest covers the bytes and how they are
        read (kind, a video's sampling, an audio's declared format): the
        caller has it already, for the embedding cache and the prefix cache,
        so 600 KB of PNG are hashed once a request, not twice."""
        if (hit := self.get(digest)) is not None:
            return hit
        media = await decode()
        self.put(digest, media)
        return media
