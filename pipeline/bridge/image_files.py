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

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import ObjectMeta
from nats.js.object_store import ObjectStore

_NAME = re.compile(r"[0-9a-f]{32}\.[a-z]{3,4}")


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
        try:
            got = await (await self._open()).get(name)
        except (nats.js.errors.ObjectNotFoundError, nats.js.errors.ObjectDeletedError, nats.js.errors.NotFoundError):
            return None
        media_type = got.info.description or "application/octet-stream"
        return bytes(got.data or b""), media_type

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
