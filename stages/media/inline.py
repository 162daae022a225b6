"""The bytes of media a request carries inline (data: URLs, inline audio),
and their digests: what a router or a worker that does not fetch media can
know of them."""

from __future__ import annotations

from schemas.errors import MmpipeError
from schemas.processed import ProcessedRequest
from stages.media.cache import item_digest
from stages.media.fetch import parse_data_url

# Read from a data: URL only to digest it: no item is larger than a NATS message.
_MAX_INLINE_BYTES = 256 << 20


def inline_bytes(req: ProcessedRequest, index: int) -> bytes | None:
    """Item ``index``'s bytes where they ride in the request; None for one
    behind a URL (only its encoder reads it) or dropped from the message."""
    item = req.media[index]
    if not item.part or req.media_dropped:
        return None
    try:
        return parse_data_url(req.media_url(item), _MAX_INLINE_BYTES).data
    except (MmpipeError, ValueError):
        return None


def inline_digest(req: ProcessedRequest, index: int) -> str:
    """Item ``index``'s content digest from its inline bytes; empty where it has none."""
    data = inline_bytes(req, index)
    return "" if data is None else item_digest(req.media[index], data)
