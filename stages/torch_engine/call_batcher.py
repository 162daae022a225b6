"""Jobs of several requests in one engine call, gathered while the engine is busy.

A worker runs several requests at once; alone, each makes its own engine
call (one vision-tower call, one prefill forward). On a GPU a call for one
small job leaves the device mostly idle. ``CallBatcher`` queues the jobs that
arrive while the engine thread is busy and hands them to the next call
together: no timer, so a lone job never waits, and under load a batch grows
to what queued up during one call, capped at ``max_items`` (a job's weight:
its media items, or 1 a request).

- A batch that fails is run again job by job, so one bad request fails
  alone and the others still get their results.
- A job whose waiter was cancelled may already be in a running call; its
  result then goes to ``orphan`` (e.g. to free a KV cache) instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from prometheus_client import Histogram

from stages.torch_engine.scheduler import EngineThread

T = TypeVar("T")
R = TypeVar("R")

BATCH_ITEMS = Histogram(
    "mmpipe_engine_batch_items",
    "Items (media items, or requests) per batched engine call",
    ["call"],
    buckets=(1, 2, 4, 8, 16, 32, 64),
)
BATCH_REQUESTS = Histogram(
    "mmpipe_engine_batch_requests",
    "Requests whose jobs one batched engine call ran",
    ["call"],
    buckets=(1, 2, 4, 8, 16, 32, 64),
)


@dataclass
class _Waiting(Generic[T, R]):
    job: T
    weight: int
    done: asyncio.Future[R] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class CallBatcher(Generic[T, R]):
    def __init__(
        self,
        name: str,
        run: Callable[[list[T]], list[R]],
        thread: EngineThread,
        max_items: int,
        weight: Callable[[T], int] = lambda _: 1,
        orphan: Callable[[R], Any] | None = None,
    ) -> None:
        if max_items < 1:
            raise ValueError(f"a {name} batch must take at least 1 item, not {max_items}")
        self.name = name
        self.run = run
        self.thread = thread
        self.max_items = max_items
        self.weight = weight
        self.orphan = orphan
        self.calls = 0
        self._queue: list[_Waiting[T, R]] = []
        self._runner: asyncio.Task[None] | None = None

    @property
    def busy(self) -> bool:
        """Jobs waiting, or a shared call still to hand its results out."""
        return bool(self._queue) or (self._runner is not None and not self._runner.done())

    async def submit(self, job: T) -> R:
        """``job``'s result, from a call shared with the jobs waiting beside it."""
        if self.max_items == 1:
            return (await self._call([job], 1))[0]
        waiting: _Waiting[T, R] = _Waiting(job, self.weight(job))
        self._queue.append(waiting)
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._loop(), name=f"{self.name}-batcher")
        try:
            return await asyncio.shield(waiting.done)
        except asyncio.CancelledError:
            if waiting in self._queue:
                self._queue.remove(waiting)
            else:
                waiting.done.add_done_callback(self._orphaned)
            raise

    def _orphaned(self, done: asyncio.Future[R]) -> None:
        if done.cancelled() or done.exception() is not None:
            return  # seen: nothing to free
        if self.orphan is not None:
            self.thread.submit(self.orphan, done.result())

    async def _call(self, jobs: list[T], items: int) -> list[R]:
        self.calls += 1
        BATCH_ITEMS.labels(self.name).observe(items)
        BATCH_REQUESTS.labels(self.name).observe(len(jobs))
        return await self.thread.call(self.run, jobs)

    def _take(self) -> list[_Waiting[T, R]]:
        """Whole jobs in arrival order up to ``max_items`` (at least one job)."""
        batch: list[_Waiting[T, R]] = []
        items = 0
        while self._queue and (not batch or items + self._queue[0].weight <= self.max_items):
            waiting = self._queue.pop(0)
            batch.append(waiting)
            items += waiting.weight
        return batch

    async def _loop(self) -> None:
        while self._queue:
            batch = self._take()
            try:
                results = await self._call([w.job for w in batch], sum(w.weight for w in batch))
            except Exception as exc:
                if len(batch) == 1:
                    _settle(batch[0], exc=exc)
                    continue
                # One bad job must not fail the others: each alone.
                for waiting in batch:
                    try:
                        _settle(waiting, (await self._call([waiting.job], waiting.weight))[0])
                    except Exception as alone:
                        _settle(waiting, exc=alone)
                continue
            for waiting, result in zip(batch, results, strict=True):
                _settle(waiting, result)


def _settle(waiting: _Waiting[Any, Any], result: Any = None, exc: BaseException | None = None) -> None:
    if waiting.done.done():
        return
    if exc is not None:
        waiting.done.set_exception(exc)
    else:
        waiting.done.set_result(result)


__all__ = ["BATCH_ITEMS", "BATCH_REQUESTS", "CallBatcher"]
