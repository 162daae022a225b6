"""A worker's health goes through its engine where the engine runs in
processes of its own (vLLM's engine core, SGLang's scheduler and
detokenizer).

If such a process dies (killed, out of memory, a fatal CUDA error), every
request fails, while the worker process, its NATS subscription and its
fetch loop carry on: it would take requests only to fail them. So:

- ``/health/ready`` asks the stage's ``health()``, the engine's
  ``check_health()`` (raises once a process of the engine is dead): the
  worker reports ``engine_dead`` (503).
- ``watch_engine`` checks the same every ``interval_s`` and, once it fails,
  logs ``<engine>_engine_dead`` and stops the worker as a SIGTERM would: it
  takes no more work, its in-flight requests fail as retryable (they go
  back to the queue for another worker) and the process exits, for its
  supervisor (``mmpipe up``, Kubernetes) to see and restart.
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


async def watch_engine(engine: _Checked, name: str, interval_s: float = 1.0) -> None:
    """``name``: the engine's, in the event logged (``vllm``, ``sglang``)."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await engine.check_health()
        except Exception as exc:
            log.error(f"{name}_engine_dead", error=repr(exc), pid=os.getpid())
            # The worker's own SIGTERM handler drains and stops it.
            os.kill(os.getpid(), signal.SIGTERM)
            return
