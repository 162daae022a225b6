"""Wire encoding: msgpack by default, JSON accepted; the ``Content-Type``
header says which. Decoders are typed and built once per message type."""

from __future__ import annotations

from typing import Generic, TypeVar

import msgspec

CONTENT_TYPE = "Content-Type"
MSGPACK = "application/msgpack"
JSON = "application/json"

T = TypeVar("T")

_msgpack_encoder = msgspec.msgpack.Encoder()
_json_encoder = msgspec.json.Encoder()


def encode(message: object, content_type: str = MSGPACK) -> bytes:
    if content_type == JSON:
        return _json_encoder.encode(message)
    return _msgpack_encoder.encode(message)


class Decoder(Generic[T]):
    """Decodes one message type from msgpack or JSON."""

    def __init__(self, type_: type[T] | object) -> None:
        self._msgpack = msgspec.msgpack.Decoder(type_)
        self._json = msgspec.json.Decoder(type_)

    def decode(self, data: bytes, content_type: str | None = None) -> T:
        """Raises ``msgspec.ValidationError`` / ``msgspec.DecodeError`` on bad input."""
        if content_type is not None and "json" in content_type:
            return self._json.decode(data)
        if content_type is None and data[:1] in (b"{", b" ", b"\n"):
            # No header (e.g. `nats pub` without -H): a JSON object starts with
            # '{'; a msgpack map never does (0x7b is a positive fixint).
            return self._json.decode(data)
        return self._msgpack.decode(data)
