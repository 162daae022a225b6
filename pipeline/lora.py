"""The LoRA adapters a deployment serves, loaded and unloaded at run time
(vLLM's ``/v1/load_lora_adapter``): kept in a JetStream key-value bucket
(name -> ``LoraAdapter``), so a processor knows which ``model`` names a
request may give, and a worker started later loads every adapter too.
Workers that run the language model watch it and load what appears; the
bridge also asks them to load at once and answer (a bad adapter is the
caller's 400 before it is kept)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import msgspec
import nats.js.errors
import structlog
from nats.js import JetStreamContext

from pipeline.subjects import Subjects
from schemas.control import LoraAdapter

log = structlog.get_logger(__name__)

# What a watcher is told: an adapter's name and its directory (None: unloaded).
OnChange = Callable[[str, str | None], Awaitable[None]]

_DECODER = msgspec.json.Decoder(LoraAdapter)


class LoraRegistry:
    """The adapters bucket: ``adapters`` (name -> directory) kept current
    by a watch, ``on_change`` called for each change after the first look."""

    def __init__(self, js: JetStreamContext, subjects: Subjects, replicas: int = 1) -> None:
        self.js = js
        self.bucket = subjects.lora_bucket
        self.replicas = replicas
        self.adapters: dict[str, str] = {}
        self.on_change: OnChange | None = None
        self._kv: object | None = None
        self._watch: asyncio.Task[None] | None = None

    async def open(self) -> None:
        """The bucket (made if new), its adapters now, and the watch of later changes."""
        try:
            kv = await self.js.key_value(self.bucket)
        except nats.js.errors.BucketNotFoundError:
            try:
                kv = await self.js.create_key_value(bucket=self.bucket, history=1, replicas=self.replicas)
            except nats.js.errors.BadRequestError:
                kv = await self.js.key_value(self.bucket)  # another process made it first
        self._kv = kv
        watcher = await kv.watchall()
        # Up to the marker (None): what the bucket holds now.
        while (entry := await watcher.updates(timeout=10.0)) is not None:
            self._apply(entry.key, entry.value, entry.operation)
        self._watch = asyncio.create_task(self._follow(watcher))

    async def _follow(self, watcher: object) -> None:
        async for entry in watcher:  # type: ignore[attr-defined]
            if entry is None:
                continue
            name, path = self._apply(entry.key, entry.value, entry.operation)
            if self.on_change is not None:
                try:
                    await self.on_change(name, path)
                except Exception as exc:  # the watch goes on: the next change is another adapter
                    log.error("lora_change_failed", adapter=name, error=repr(exc))

    def _apply(self, key: str, value: bytes | None, operation: str | None) -> tuple[str, str | None]:
        if operation in ("DEL", "PURGE") or not value:
            self.adapters.pop(key, None)
            return key, None
        adapter = _DECODER.decode(value)
        self.adapters[adapter.name] = adapter.path
        return adapter.name, adapter.path

    async def put(self, name: str, path: str) -> None:
        assert self._kv is not None, "open() the registry first"
        await self._kv.put(name, msgspec.json.encode(LoraAdapter(name, path)))  # type: ignore[attr-defined]
        self.adapters[name] = path

    async def delete(self, name: str) -> None:
        assert self._kv is not None, "open() the registry first"
        await self._kv.delete(name)  # type: ignore[attr-defined]
        self.adapters.pop(name, None)

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
