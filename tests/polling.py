"""Waiting for a condition in a test: poll it, with a deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


async def eventually(check: Callable[[], bool], within: float = 2.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def eventually_true(check: Callable[[], Awaitable[bool]], within: float = 10.0, what: str = "condition") -> None:
    """``eventually`` for a check that must await (ask another process)."""
    deadline = time.monotonic() + within
    while not await check():
        assert time.monotonic() < deadline, f"{what}: not met within {within} s"
        await asyncio.sleep(0.02)
