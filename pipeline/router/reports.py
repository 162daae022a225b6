"""What a hop worker tells routers (--router kv): its load, every half
second and soon after a request starts or ends (a router that weighs a
cache hit against the worker's load must not count a request that just
finished: a conversation's next turn comes right after it), and which
media's embeddings its cache took in or let go."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import structlog
from nats.aio.client import Client

from pipeline.subjects import Subjects
from schemas.codec import encode
from schemas.control import EmbeddingsHeld, WorkerLoad

log = structlog.get_logger(__name__)

LOAD_EVERY_S = 0.5
LOAD_AT_MOST_EVERY_S = 0.02


class WorkerReports:
    def __init__(self, nc: Client, subjects: Subjects, worker_id: str, load: Callable[[bool], WorkerLoad]) -> None:
        self.nc = nc
        self.subjects = subjects
        self.worker_id = worker_id
        self.load = load
        self._changed = asyncio.Event()
        self._embeddings = EmbeddingsHeld()

    def changed(self) -> None:
        self._changed.set()

    def embeddings_changed(self, media: str, stored: bool) -> None:
        (self._embeddings.stored if stored else self._embeddings.removed).append(media)
        self._changed.set()

    async def run(self) -> None:
        while True:
            self._changed.clear()
            await self._publish_embeddings()
            await self.publish_load()
            await asyncio.sleep(LOAD_AT_MOST_EVERY_S)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), LOAD_EVERY_S - LOAD_AT_MOST_EVERY_S)

    async def publish_load(self, draining: bool = False) -> None:
        try:
            await self.nc.publish(self.subjects.load(self.worker_id), encode(self.load(draining)))
        except Exception as exc:  # reconnecting: the next report may get through
            log.warning("load_report_failed", worker_id=self.worker_id, error=repr(exc))

    async def _publish_embeddings(self) -> None:
        held, self._embeddings = self._embeddings, EmbeddingsHeld()
        if not (held.stored or held.removed):
            return
        try:
            await self.nc.publish(self.subjects.embeddings(self.worker_id), encode(held))
        except Exception as exc:  # reconnecting: a router then misses it, and routes by luck
            log.warning("embeddings_report_failed", worker_id=self.worker_id, error=repr(exc))
