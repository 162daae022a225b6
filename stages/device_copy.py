"""Host tensors onto the device without waiting for the device.

A copy from ordinary (pageable) host memory to a GPU returns only once it
is done, and it is queued behind everything already on the stream: a
request's token ids copied up while the decode steps, towers and prefills of
others are queued waits for all of them. On one engine thread that wait
was a third of its time under load (stacks sampled on an H100, 64
clients). Staged through pinned memory the copy is queued like a kernel
and the thread goes on.

Pinning each tensor anew (``Tensor.pin_memory()``) cost about 1 ms per MB
(half the engine thread's CPU under 64 clients, an H100 host: a 448×448
image's pixels each request), so small tensors are staged through one
pinned buffer per device, used as a ring: each copy takes the next bytes
and records an event, and bytes are taken again only once the copy that
used them last has run (``StagingRing``).
"""

from __future__ import annotations

import collections
import threading
from typing import Protocol

import torch

# Pinned bytes per device for staging; a tensor over a quarter of it is pinned on its own.
STAGING_BYTES = 64 << 20
# Each staged tensor starts on this boundary (any dtype's alignment).
_ALIGN = 64


class _Done(Protocol):
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class StagingRing:
    """Which bytes of a ring of ``capacity`` the next copy may use: in order,
    wrapping at the end, waiting (``synchronize``) only for copies still
    reading the bytes it is about to reuse."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._head = 0
        # (start, end, done) of copies that may still read their bytes, oldest first.
        self._inflight: collections.deque[tuple[int, int, _Done]] = collections.deque()

    def reserve(self, nbytes: int) -> int:
        """The offset of ``nbytes`` free bytes (after any wait for them)."""
        if nbytes > self.capacity:
            raise ValueError(f"{nbytes} bytes do not fit a staging ring of {self.capacity}")
        start = -(-self._head // _ALIGN) * _ALIGN
        if start + nbytes > self.capacity:
            start = 0
        end = start + nbytes
        while self._inflight and self._inflight[0][2].query():
            self._inflight.popleft()
        for lo, hi, done in list(self._inflight):
            if lo < end and start < hi:
                done.synchronize()
                self._inflight.remove((lo, hi, done))
        self._head = end
        return start

    def used(self, start: int, nbytes: int, done: _Done) -> None:
        """The copy from ``start`` reads its bytes until ``done``."""
        self._inflight.append((start, start + nbytes, done))


class _PinnedStaging:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffer = torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True)
        self.ring = StagingRing(STAGING_BYTES)
        self.lock = threading.Lock()

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        nbytes = tensor.numel() * tensor.element_size()
        with self.lock:
            start = self.ring.reserve(nbytes)
            staged = self.buffer[start : start + nbytes].view(tensor.dtype).view(tensor.shape)
            staged.copy_(tensor)
            with torch.cuda.device(self.device):
                moved = staged.to(self.device, non_blocking=True)
                done = torch.cuda.Event()
                done.record()
            self.ring.used(start, nbytes, done)
        return moved


_staging: dict[torch.device, _PinnedStaging] = {}
_staging_lock = threading.Lock()


def _staging_for(device: torch.device) -> _PinnedStaging:
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _staging_lock:
        if device not in _staging:
            _staging[device] = _PinnedStaging(device)
        return _staging[device]


def to_device(tensor: torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``tensor`` (on the host) on ``device``, queued, not waited for."""
    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device, dtype) if dtype is not None else tensor.to(device)
    if tensor.numel() * tensor.element_size() <= STAGING_BYTES // 4:
        moved = _staging_for(device).copy(tensor)
    else:
        moved = tensor.pin_memory().to(device, non_blocking=True)
    return moved.to(dtype) if dtype is not None else moved


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous host copy of ``tensor``. From a GPU: into pinned memory,
    the calling thread asleep until the copy has run. A plain ``.to("cpu")``
    waits for everything queued on the stream as well, but it spins in the
    driver meanwhile: the embedding cache's copies were 30% of the media
    threads' CPU under 64 clients (an H100 host), CPU the engine's thread
    competes for. (Its effect on requests/s alone was within that run's
    noise.)"""
    if tensor.device.type != "cuda":
        return tensor.detach().clone(memory_format=torch.contiguous_format)
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    with torch.cuda.device(tensor.device):
        host.copy_(tensor.detach(), non_blocking=True)
        done = torch.cuda.Event(blocking=True)
        done.record()
    done.synchronize()
    return host


def tensor_on(data: object, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.tensor(data, dtype=dtype)`` made on the host and queued onto ``device``."""
    return to_device(torch.tensor(data, dtype=dtype), device)
