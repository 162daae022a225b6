"""Waiting for a condition in a test: poll it, with a deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def eventually(check: Callable[[], bool], within: float = 2.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)
