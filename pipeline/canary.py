"""A worker's canary health check, as NVIDIA Dynamo's vLLM backend runs
one: when the worker has been idle for ``--canary-interval`` seconds it
pushes a tiny request through its own engine (a few prompt tokens and one
token chosen; an image through the encoder where its role encodes). A
canary that fails or outlasts ``--canary-timeout`` marks the worker
unhealthy: its readiness answers 503, its ping reply says so (the bridge
counts it out of its role), and it fetches no more work. Canaries go on
while it is unhealthy (it is idle then); one that passes makes it healthy
again. Its own process stays up: what it holds finishes or is taken over
as ever, and an orchestrator decides from readiness.

The canary runs only while the worker is idle, so a busy worker, whose
requests show its health, spends nothing on it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog

from pipeline import metrics
from schemas.settings import setting

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class CanarySettings:
    interval_s: float = setting(
        0.0,
        flag="canary-interval",
        help="seconds a worker is idle before it pushes a tiny request through its own engine, a canary health "
        "check (0: none); a canary that fails or times out marks the worker unhealthy",
    )
    timeout_s: float = setting(
        30.0, flag="canary-timeout", help="seconds a canary may take before the worker counts it failed"
    )

    def __post_init__(self) -> None:
        if self.interval_s < 0 or self.timeout_s <= 0:
            raise ValueError("--canary-interval must be >= 0 and --canary-timeout > 0")


class Canary:
    """Runs ``probe`` (the stage's canary) after ``idle_s()`` reaches the
    interval, and holds the verdict: ``healthy``, and what failed (``problem``)."""

    def __init__(
        self, settings: CanarySettings, role: str, probe: Callable[[], Awaitable[None]], idle_s: Callable[[], float]
    ) -> None:
        self.settings = settings
        self.role = role
        self._probe = probe
        self._idle_s = idle_s
        self.healthy = True
        self.problem = ""
        self.last_run: float | None = None

    async def run(self, stopping: asyncio.Event) -> None:
        interval = self.settings.interval_s
        while not stopping.is_set():
            since_canary = time.monotonic() - self.last_run if self.last_run is not None else interval
            wait = max(interval - min(self._idle_s(), since_canary), 0.05)
            try:
                await asyncio.wait_for(stopping.wait(), wait)
                return
            except TimeoutError:
                pass
            since_canary = time.monotonic() - self.last_run if self.last_run is not None else interval
            if min(self._idle_s(), since_canary) >= interval:
                await self.check()

    async def check(self) -> bool:
        """One canary now: the verdict, also kept."""
        started = time.monotonic()
        problem = ""
        try:
            await asyncio.wait_for(self._probe(), self.settings.timeout_s)
        except TimeoutError:
            problem = f"the canary took more than {self.settings.timeout_s:g} s"
            reason = "timeout"
        except Exception as exc:
            problem = f"the canary failed: {exc!r}"
            reason = "error"
        seconds = time.monotonic() - started
        self.last_run = time.monotonic()
        metrics.CANARY_SECONDS.labels(self.role).observe(seconds)
        if problem:
            metrics.CANARY_FAILURES.labels(self.role, reason).inc()
            log.error("canary_failed", role=self.role, reason=reason, error=problem, seconds=round(seconds, 3))
        elif not self.healthy:
            log.info("canary_recovered", role=self.role, seconds=round(seconds, 3))
        self.healthy, self.problem = not problem, problem
        return self.healthy
