"""Cancellation: the bridge publishes ``mmpipe.<ns>.cancel.<request_id>``;
every worker aborts that request's task."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from pipeline import metrics
from pipeline.subjects import Subjects

log = structlog.get_logger(__name__)


class CancelRegistry:
    """Tasks by request id, and request ids cancelled lately (a cancel may
    arrive before the message it is about)."""

    def __init__(self, remember_s: float = 600.0, remember_max: int = 100_000) -> None:
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._cancelled: OrderedDict[str, float] = OrderedDict()
        self._remember_s = remember_s
        self._remember_max = remember_max
        self._sub: Subscription | None = None

    def register(self, request_id: str, task: asyncio.Task[None]) -> None:
        self._tasks[request_id] = task

    def unregister(self, request_id: str) -> None:
        self._tasks.pop(request_id, None)

    def is_cancelled(self, request_id: str) -> bool:
        return request_id in self._cancelled

    def cancel(self, request_id: str) -> bool:
        now = time.monotonic()
        self._cancelled[request_id] = now
        while self._cancelled and (
            len(self._cancelled) > self._remember_max or next(iter(self._cancelled.values())) < now - self._remember_s
        ):
            self._cancelled.popitem(last=False)
        task = self._tasks.get(request_id)
        if task is None or task.done():
            return False
        task.cancel()
        return True

    async def listen(
        self, nc: Client, subjects: Subjects, also: Callable[[str], Awaitable[object]] | None = None
    ) -> None:
        """``also`` runs for every cancel, running here or not: a worker may
        hold tensors for a request it has already handed on."""
        prefix = subjects.cancel("")

        async def on_cancel(msg: Msg) -> None:
            request_id = msg.subject[len(prefix) :]
            if self.cancel(request_id):
                log.info("request_cancelled", request_id=request_id)
            if also is not None:
                try:
                    await also(request_id)
                except Exception as exc:
                    metrics.ERRORS.labels("cancel", "cleanup_failed").inc()
                    log.error("cancel_cleanup_failed", request_id=request_id, error=repr(exc))

        self._sub = await nc.subscribe(subjects.cancels, cb=on_cancel)

    async def close(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
