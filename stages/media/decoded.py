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

from collections import OrderedDict
from typing import Final

from PIL import Image
from prometheus_client import Counter

from stages.media.audio import DecodedAudio
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
        self.capacity = capacity_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, tuple[Decoded, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> Decoded | None:
        entry = self._entries.get(key)
        LOOKUPS.labels("hit" if entry is not None else "miss").inc()
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: str, media: Decoded) -> None:
        size = decoded_nbytes(media)
        if size > self.capacity or key in self._entries:
            return
        while self.bytes + size > self.capacity:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.bytes -= evicted
        self._entries[key] = (media, size)
        self.bytes += size
