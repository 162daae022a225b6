"""Holder-side bookkeeping of the NIXL transport: which arena regions are
held for readers, who may read them now, and when they are freed.

A region goes: reserved (being filled) -> held -> leased to one reader ->
freed when that reader's READ notification comes back. A reader that
already knows the holder posts its READ together with its lease request,
so the notification can come before the request: it is kept, and counts
once that lease is granted (the region was then still held, and so was
never reused under the READ). A lease that lapses
without one (the reader died or gave up) returns the region to held, so a
redelivered message can still read it. A region read or released while a
lease is out is freed only when that lease ends: the reader may be in the
middle of its READ, and reusing the memory under it would hand it another
request's bytes. The TTL frees regions nobody read, so a dead reader leaks
nothing.
"""

from __future__ import annotations

import asyncio
import collections
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import structlog

from pipeline.transport import metrics
from pipeline.transport.arena import FirstFit
from pipeline.transport.base import TransportFull

log = structlog.get_logger(__name__)


@dataclass
class Held:
    key: str
    owner: str
    offset: int
    size: int
    expires: float = 0.0
    lease: int = 0
    lease_until: float = 0.0
    # Read or released: free as soon as no lease pins it.
    done: bool = False
    # Set once the ref may go out: the bytes are in place, or queued on
    # the GPU behind ``landing``.
    ready: bool = False
    # A CUDA event the copy into the region completes; None once it has.
    landing: Any = None
    # Every lease granted on it: a READ notification counts only under one of them.
    granted: list[int] = field(default_factory=list)
    # Notifications of READs whose lease was not granted (yet): posted beside the request.
    early: set[int] = field(default_factory=set)


# A reader refused a lease leaves its early notification behind: keep only a few.
_EARLY_MAX = 8
# Regions freed after a READ, remembered with its lease: the newest this many.
_READ_MEMORY = 4096


class HeldRegions:
    def __init__(self, transport: str, size: int, ttl_s: float) -> None:
        self.transport = transport
        self.size = size
        self.ttl_s = ttl_s
        self._alloc = FirstFit(size)
        self._regions: dict[str, Held] = {}
        self._freed = asyncio.Event()
        self._wake = asyncio.Event()
        # Key -> the lease whose READ completed before the region was freed.
        self._read_under: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._gauge = metrics.HELD_BYTES.labels(transport)

    @property
    def used_bytes(self) -> int:
        return self._alloc.used_bytes

    @property
    def count(self) -> int:
        return len(self._regions)

    def get(self, key: str) -> Held | None:
        return self._regions.get(key)

    def has_room(self, nbytes: int = 0) -> bool:
        if nbytes <= 0:
            return self.used_bytes < self.size
        return self.used_bytes + self._alloc.region_size(nbytes) <= self.size and self._alloc.fits(nbytes)

    async def reserve(self, nbytes: int, *, owner: str, wait_s: float) -> Held:
        """A region of ``nbytes``; waits up to ``wait_s`` for frees."""
        if self._alloc.region_size(nbytes) > self.size:
            metrics.ERRORS.labels(self.transport, "too_large").inc()
            raise TransportFull(f"{nbytes} bytes of tensors exceed the whole tensor budget of {self.size} bytes")
        deadline = time.monotonic() + wait_s
        while (offset := self._alloc.alloc(nbytes)) is None:
            self._freed.clear()
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    await self._freed.wait()
            except TimeoutError:
                metrics.ERRORS.labels(self.transport, "full").inc()
                raise TransportFull(
                    f"tensor budget full: {self.used_bytes} of {self.size} bytes held, "
                    f"{nbytes} more needed, waited {wait_s:.1f}s"
                ) from None
        held = Held(key=uuid.uuid4().hex, owner=owner, offset=offset, size=self._alloc.region_size(nbytes))
        self._regions[held.key] = held
        self._gauge.inc(held.size)
        return held

    def publish(self, held: Held) -> None:
        held.expires = time.time() + self.ttl_s
        held.ready = True
        self._wake.set()

    def free(self, held: Held) -> None:
        if self._regions.pop(held.key, None) is None:
            return
        self._alloc.free(held.offset)
        self._gauge.dec(held.size)
        self._freed.set()

    def lease(self, key: str, lease: int, lease_s: float) -> str:
        """Pin ``key`` for one reader (again for the reader that holds
        ``lease``, or whose READ under it freed the region); returns why not
        ("unknown": never held or already freed, "read_or_released",
        "claimed" by another reader, "expired"), or "" when granted."""
        held = self._regions.get(key)
        if held is None and self._read_under.get(key) == lease:
            # Its reader asking again, the answer that granted the lease
            # lost, its READ already done (a READ posted beside its request):
            # that READ completed before the region was freed, so the bytes
            # it got are the ref's.
            return ""
        if held is None or not held.ready:
            return "unknown"
        if held.done:
            return "read_or_released"
        if held.lease == lease:
            # Its reader asking again, its answer lost: pinned afresh from
            # now, as the reader measures its lease from its new request.
            held.lease_until = max(held.lease_until, time.monotonic() + lease_s)
            return ""
        if held.lease:
            return "claimed"
        if time.time() > held.expires:
            return "expired"
        held.granted.append(lease)
        if lease in held.early:
            # Its READ completed before this grant, while the region was still held: read.
            held.done = True
            self._remember_read(key, lease)
            self.free(held)
            return ""
        held.lease = lease
        held.lease_until = time.monotonic() + lease_s
        self._wake.set()  # the poller must drive UCX progress and catch the notification now
        return ""

    def end_lease(self, key: str, lease: int, *, read: bool) -> bool:
        """A reader finished (``read``: its READ completed) or gave its lease back."""
        held = self._regions.get(key)
        if held is None:
            return False
        if read and lease not in held.granted:
            if len(held.early) < _EARLY_MAX:
                held.early.add(lease)
            return True
        if read:
            # Even a notification of an older, lapsed lease means the bytes were read.
            held.done = True
            self._remember_read(key, lease)
        if held.lease == lease:
            held.lease = 0
        if held.done and not held.lease:
            self.free(held)
        return True

    def _remember_read(self, key: str, lease: int) -> None:
        self._read_under[key] = lease
        self._read_under.move_to_end(key)
        while len(self._read_under) > _READ_MEMORY:
            self._read_under.popitem(last=False)

    def release(self, key: str) -> None:
        held = self._regions.get(key)
        if held is None:
            return
        held.done = True
        if not held.lease:
            self.free(held)

    def release_owner(self, owner: str) -> int:
        """Release every region held for ``owner`` (a cancelled request)."""
        mine = [held.key for held in self._regions.values() if held.owner == owner]
        for key in mine:
            self.release(key)
        return len(mine)

    def any_leased(self) -> bool:
        return any(h.lease for h in self._regions.values())

    def sweep(self) -> None:
        """Lapse overdue leases; free what is done or past its TTL."""
        now, wall = time.monotonic(), time.time()
        for held in list(self._regions.values()):
            if held.lease and now > held.lease_until:
                metrics.ERRORS.labels(self.transport, "lease_lapsed").inc()
                log.warning("tensor_lease_lapsed", transport=self.transport, key=held.key, owner=held.owner)
                held.lease = 0
            if held.lease or not held.ready:
                continue
            if held.done:
                self.free(held)
            elif wall > held.expires:
                metrics.EXPIRED.labels(self.transport).inc()
                log.warning(
                    "tensor_expired_unread", transport=self.transport, key=held.key, owner=held.owner, ttl_s=self.ttl_s
                )
                self.free(held)

    async def nap(self, seconds: float) -> None:
        """Sleep up to ``seconds``; less when a put or a lease needs the poller."""
        try:
            async with asyncio.timeout(seconds):
                await self._wake.wait()
        except TimeoutError:
            pass
        self._wake.clear()

    def clear(self) -> None:
        for held in list(self._regions.values()):
            self.free(held)
