"""A hop worker's own subject in its role's work queue (--router kv):
what a router sent it. Started at once in a free slot, or held (at most a
slot's worth, ahead of the shared queue) until one frees; what waits
``routed_wait_s`` since it was sent, and all of it when the worker stops,
goes back to the shared queue."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import structlog
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext

from pipeline.config import PipelineConfig
from pipeline.router.requeue import requeue
from pipeline.streams import retrying, routed_consumer_config

log = structlog.get_logger(__name__)


class RoutedInbox:
    def __init__(
        self,
        js: JetStreamContext,
        config: PipelineConfig,
        role: str,
        worker_id: str,
        capacity: int,
        has_slot: Callable[[], bool],
        start: Callable[[Msg], None],
    ) -> None:
        self.js = js
        self.config = config
        self.subjects = config.subjects
        self.role = role
        self.worker_id = worker_id
        self.capacity = capacity
        self.has_slot = has_slot
        self.start = start
        # Taken from the subject, not started yet (oldest first).
        self.waiting: list[Msg] = []
        self._sub: Any = None

    async def open(self) -> None:
        cfg = routed_consumer_config(self.config, self.role, self.worker_id)
        stream = self.subjects.stream(self.role)
        await retrying(cfg.durable_name or "", lambda: self.js.add_consumer(stream, cfg), 60.0)
        self._sub = await self.js.pull_subscribe_bind(cfg.durable_name, stream)

    def next_waiting(self) -> Msg | None:
        """The oldest held message, where a slot is free for it."""
        return self.waiting.pop(0) if self.waiting and self.has_slot() else None

    async def run(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            await self._requeue_waited()
            if len(self.waiting) >= self.capacity:
                await asyncio.sleep(0.05)
                continue
            try:
                msgs = await self._sub.fetch(1, timeout=0.25)
            except (TimeoutError, NatsTimeoutError):
                continue
            except Exception as exc:
                # The connection is down (nats-py reconnects), or a router took
                # this worker for gone and removed its consumer: make it again.
                log.warning("routed_fetch_failed", role=self.role, error=repr(exc))
                await asyncio.sleep(0.5)
                with contextlib.suppress(Exception):
                    await self.open()
                continue
            for msg in msgs:
                if not stopping.is_set() and self.has_slot():
                    self.start(msg)
                else:
                    self.waiting.append(msg)

    async def _requeue_waited(self) -> None:
        limit = self.config.router.routed_wait_s
        now = time.time()
        for msg in list(self.waiting):
            sent = msg.metadata.timestamp
            if sent is not None and now - sent.timestamp() < limit:
                continue
            try:
                await requeue(self.js, self.subjects, self.role, msg, "waited")
            except Exception as exc:  # still held: the next turn tries again
                log.warning("routed_requeue_failed", role=self.role, error=repr(exc))
                continue
            self.waiting.remove(msg)

    async def give_back(self) -> None:
        """Stopping: what waits here and what is still queued for this
        worker alone goes back to the shared queue, then its consumer goes."""
        if self._sub is None:
            return
        try:
            while True:
                for msg in list(self.waiting):
                    await requeue(self.js, self.subjects, self.role, msg, "drained")
                    self.waiting.remove(msg)
                try:
                    self.waiting = list(await self._sub.fetch(64, timeout=0.2))
                except (TimeoutError, NatsTimeoutError):
                    break
            await self._sub.unsubscribe()
            await self.js.delete_consumer(
                self.subjects.stream(self.role), self.subjects.routed_durable(self.role, self.worker_id)
            )
        except Exception as exc:  # a router's rescuer moves what is left once the consumer expires
            log.warning("routed_give_back_failed", role=self.role, error=repr(exc), waiting=len(self.waiting))
