"""Images answered by URL (``response_format: "url"``): each kept for a
while in a JetStream object store bucket, so that any bridge of the
deployment serves it at ``GET /v1/images/files/{name}``. The names are
128 random bits, so a URL works without the API key, as OpenAI's signed
image URLs do; the bucket's TTL ends it (``--image-url-ttl``, an hour:
OpenAI's URLs last as long)."""

from __future__ import annotations

import asyncio
import re
import uuid
from datetime import UTC, datetime

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import ObjectInfo, ObjectMeta
from nats.js.object_store import ObjectStore

_NAME = re.compile(r"[0-9a-f]{32}\.[a-z]{3,4}")
# An image this close to its TTL is treated as gone (clocks differ between hosts).
_MARGIN_S = 5.0
# A whole image read from the store takes far less.
_READ_S = 10.0


class ImageFiles:
    def __init__(self, js: JetStreamContext, bucket: str, ttl_s: float, replicas: int = 1) -> None:
        self._js = js
        self._bucket = bucket
        self._ttl_s = ttl_s
        self._replicas = replicas
        self._store: ObjectStore | None = None
        self._opening = asyncio.Lock()

    async def put(self, data: bytes, media_type: str) -> str:
        """Keep ``data``; the name to fetch it by."""
        name = f"{uuid.uuid4().hex}.{media_type.removeprefix('image/')}"
        meta = ObjectMeta(name=name, description=media_type)
        await (await self._open()).put(name, data, meta=meta)
        return name

    async def get(self, name: str) -> tuple[bytes, str] | None:
        """The image and its media type; None where the name was never
        given or its time is up."""
        if not _NAME.fullmatch(name):
            return None
        store = await self._open()
        try:
            # The chunks expire a little before the description (written last):
            # nats-py's get of an object whose chunks are gone waits for them
            # forever, so an image about to expire is gone already here, and
            # a read that still finds no chunks is cut off.
            if self._expiring(await store.get_info(name)):
                return None
            async with asyncio.timeout(_READ_S):
                got = await store.get(name)
        except (
            nats.js.errors.ObjectNotFoundError,
            nats.js.errors.ObjectDeletedError,
            nats.js.errors.NotFoundError,
            TimeoutError,
        ):
            return None
        media_type = got.info.description or "application/octet-stream"
        return bytes(got.data or b""), media_type

    def _expiring(self, info: ObjectInfo) -> bool:
        """Whether the bucket's TTL ends this object within the margin (or
        has: the server's clock may be ahead of this one)."""
        try:
            written = datetime.fromisoformat(info.mtime or "")
        except ValueError:
            return False
        age = (datetime.now(UTC) - written).total_seconds()
        return age >= self._ttl_s - min(_MARGIN_S, self._ttl_s / 4)

    async def _open(self) -> ObjectStore:
        async with self._opening:
            if self._store is None:
                try:
                    self._store = await self._js.object_store(self._bucket)
                except nats.js.errors.BucketNotFoundError:
                    try:
                        self._store = await self._js.create_object_store(
                            self._bucket, ttl=self._ttl_s, replicas=self._replicas
                        )
                    except nats.js.errors.BadRequestError:
                        self._store = await self._js.object_store(self._bucket)  # another bridge made it first
            return self._store
