"""One encoder call for the media of several requests.

An encode worker works on several requests at once (its fetch batch). Each
of them alone makes one tower call per kind; on a GPU a call for one
448×448 image leaves the device mostly idle, while eight images in one call
cost little more than one. ``EncodeBatcher`` gathers the requests that
arrive while the encoder is busy and encodes them together in its next call:
no timer, so a lone request is never held back, and under load the batch
grows to what has queued up during one call (capped by ``max_items``).

Why it is off by default (``--encode-batch 1``): an encoder's numerics depend
on the set of items it runs over. Qwen-VL's tower concatenates the patches of
every image of a call, so a GEMM over a different number of rows can round
differently; on CPU one image in four came out different in its last bits.
generate() encodes a request's media alone, so the per-request call is what
keeps mmpipe's promise of generate()'s exact tokens. Batching across requests
is the throughput choice for GPU deployments that accept last-bit
differences in the embeddings, the same trade every batching server makes.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from prometheus_client import Histogram

from stages.engine import MediaEmbedding, TorchEngine
from stages.families import Media
from stages.scheduler import EngineThread

BATCH_ITEMS = Histogram(
    "mmpipe_encode_batch_items",
    "Media items per encoder call (several requests' items with --encode-batch above 1)",
    buckets=(1, 2, 4, 8, 16, 32, 64),
)
BATCH_REQUESTS = Histogram(
    "mmpipe_encode_batch_requests",
    "Requests whose media one encoder call encoded",
    buckets=(1, 2, 4, 8, 16, 32, 64),
)


@dataclass
class _Waiting:
    media: list[Media]
    done: asyncio.Future[list[MediaEmbedding]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class EncodeBatcher:
    def __init__(self, engine: TorchEngine, thread: EngineThread, max_items: int) -> None:
        if max_items < 1:
            raise ValueError(f"--encode-batch must be at least 1, not {max_items}")
        self.engine = engine
        self.thread = thread
        self.max_items = max_items
        self.calls = 0
        self._queue: list[_Waiting] = []
        self._runner: asyncio.Task[None] | None = None

    async def encode(self, media: list[Media]) -> list[MediaEmbedding]:
        """The embeddings of one request's media, made in a call shared with
        whatever other requests wait at the same time."""
        if self.max_items == 1:
            self.calls += 1
            BATCH_ITEMS.observe(len(media))
            BATCH_REQUESTS.observe(1)
            return await self.thread.call(self.engine.encode, media)
        waiting = _Waiting(list(media))
        self._queue.append(waiting)
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._run(), name="encode-batcher")
        try:
            return await asyncio.shield(waiting.done)
        except asyncio.CancelledError:
            # The request was cancelled: its items may still be encoded with the
            # others (the batch is already running), but nobody waits for them.
            if waiting in self._queue:
                self._queue.remove(waiting)
            # Mark its outcome as seen, so asyncio does not log it as never retrieved.
            waiting.done.add_done_callback(lambda f: f.cancelled() or f.exception())
            raise

    def _take(self) -> list[_Waiting]:
        """Whole requests in arrival order up to ``max_items`` items (at least one request)."""
        batch: list[_Waiting] = []
        items = 0
        while self._queue and (not batch or items + len(self._queue[0].media) <= self.max_items):
            waiting = self._queue.pop(0)
            batch.append(waiting)
            items += len(waiting.media)
        return batch

    async def _run(self) -> None:
        while self._queue:
            batch = self._take()
            media = [m for w in batch for m in w.media]
            self.calls += 1
            BATCH_ITEMS.observe(len(media))
            BATCH_REQUESTS.observe(len(batch))
            try:
                encoded = await self.thread.call(self.engine.encode, media)
            except Exception as exc:
                if len(batch) == 1:
                    _settle(batch[0], exc=exc)
                    continue
                # One bad item must not fail the others: encode each request alone.
                for waiting in batch:
                    try:
                        _settle(waiting, await self.thread.call(self.engine.encode, waiting.media))
                    except Exception as alone:
                        _settle(waiting, exc=alone)
                continue
            it = iter(encoded)
            for waiting in batch:
                _settle(waiting, [next(it) for _ in waiting.media])


def _settle(waiting: _Waiting, result: list[MediaEmbedding] | None = None, exc: BaseException | None = None) -> None:
    if waiting.done.done():
        return
    if exc is not None:
        waiting.done.set_exception(exc)
    else:
        assert result is not None
        waiting.done.set_result(result)


__all__ = ["BATCH_ITEMS", "BATCH_REQUESTS", "EncodeBatcher"]
