"""A vLLM worker's health goes through vLLM.

vLLM runs the model in an engine-core child process. If that process dies
(killed, out of memory, a fatal CUDA error), ``AsyncLLM`` marks itself dead
and every request fails with ``EngineDeadError``, while the worker process,
its NATS subscription and its fetch loop carry on: it would take requests
only to fail them. So:

- ``/health/ready`` asks the stage's ``health()``, which is
  ``AsyncLLM.check_health()`` (raises once the engine core is dead): the
  worker reports ``engine_dead`` (503).
- ``watch_engine`` checks the same every ``interval_s`` and, once it fails,
  logs ``vllm_engine_dead`` and stops the worker as a SIGTERM would: it takes
  no more work, its in-flight requests fail as retryable (they go back to
  the queue for another worker) and the process exits, for its supervisor
  (``mmpipe up``, Kubernetes) to see and restart.
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Protocol

import structlog

log = structlog.get_logger(__name__)


class _Checked(Protocol):
    async def check_health(self) -> None: ...


async def watch_engine(engine: _Checked, interval_s: float = 1.0) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            await engine.check_health()
        except Exception as exc:
            log.error("vllm_engine_dead", error=repr(exc), pid=os.getpid())
            # The worker's own SIGTERM handler drains and stops it.
            os.kill(os.getpid(), signal.SIGTERM)
            return
