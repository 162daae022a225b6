"""Copies between tensors without stalling the event loop.

A 64 MB host copy takes ~10-30 ms: long enough to delay every other request
of the worker, so large copies go to a thread (torch releases the GIL while
it copies). CUDA copies are queued on a stream, so they are synchronized
before the bytes are handed to NIXL, which reads memory outside any stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import torch

# Below this a thread hop (~50 µs) costs more than the copy itself.
THREAD_MIN_BYTES = 1 << 20


def _sync(devices: tuple[torch.device, ...]) -> None:
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


async def copy_bytes(copy: Callable[[], object], nbytes: int, *devices: torch.device) -> None:
    """Run ``copy`` and wait until its bytes have landed on every device involved."""
    if nbytes < THREAD_MIN_BYTES and all(d.type == "cpu" for d in devices):
        copy()
        return

    def run() -> None:
        copy()
        _sync(devices)

    await asyncio.to_thread(run)
