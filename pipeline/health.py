"""A worker's own HTTP endpoints, on a port of its own (``--health-port``), so
an orchestrator can probe it and Prometheus can scrape it:

- ``GET /health/ready``: 200 when the worker is connected to NATS, its
  role's durable consumer exists and its engine answers (the stage's
  ``health()``: vLLM's engine core alive, the built-in engine's decode loop
  running), else 503. A worker that is starting or draining, or whose
  last canary health check failed (pipeline/canary.py), is not ready either.
- ``GET /health/live``: 200 while the worker makes progress (its fetch loop
  turns, or one of its requests produces output); 503 once it has made none
  for ``stall_after_s``. A NATS outage is not a reason to restart a worker,
  so it leaves liveness alone (readiness says it).
- ``GET /metrics``: the Prometheus text of this process's registry.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pipeline.metrics import before_scrape
from pipeline.streams import consumer_exists
from schemas.control import SleepState
from schemas.settings import setting

if TYPE_CHECKING:
    from pipeline.worker import Worker

log = structlog.get_logger(__name__)

READY_PATH = "/health/ready"
LIVE_PATH = "/health/live"
METRICS_PATH = "/metrics"
# POST: the worker forgets its prefix cache (the bridge's /v1/cache/reset asks every worker at once).
CACHE_RESET_PATH = "/cache/reset"
# vLLM's sleep mode: POST /sleep?level=1|2, POST /wake_up, GET /is_sleeping.
SLEEP_PATH = "/sleep"
WAKE_UP_PATH = "/wake_up"
IS_SLEEPING_PATH = "/is_sleeping"


@dataclass(frozen=True)
class HealthSettings:
    # 0: no endpoints (a bare-host worker needs none).
    port: int = setting(
        0,
        flag="health-port",
        help="serve /health/ready, /health/live and /metrics on this port (0: none); mmpipe up: the first of "
        "consecutive ports, one a worker in start order",
    )
    # Loopback by default, like the bridge; a pod binds 0.0.0.0 so the
    # kubelet and Prometheus reach it.
    host: str = setting("127.0.0.1", flag="health-host", help="the address the health port listens on")
    # The fetch loop turns at least once a second while it has free slots, and
    # every output of a request counts as progress: this long without either
    # means the worker is stuck (a long prefill must fit well inside it).
    stall_after_s: float = setting(
        120.0, flag="health-stall-after", help="seconds without progress after which /health/live answers 503"
    )
    # A probe must answer within the kubelet's timeout even when JetStream is slow.
    consumer_check_timeout_s: float = 2.0


Verdict = tuple[bool, dict[str, Any]]


def _state(state: SleepState) -> web.Response:
    """A worker's sleep state as JSON: 400 for a level it cannot take, 501
    where its engine has no sleep mode, 500 where it failed."""
    status = 200
    if not state.supported:
        status = 501
    elif state.error:
        status = 400 if "sleep level" in state.error else 500
    return web.json_response({"is_sleeping": bool(state.sleeping), **msgspec.structs.asdict(state)}, status=status)


class WorkerHealth:
    """Answers the probes from a worker's state. The worker is attached once
    it exists: until then (NATS not reached yet, the model loading) the
    process is live but not ready."""

    def __init__(self, settings: HealthSettings | None = None) -> None:
        self.settings = settings or HealthSettings()
        self.worker: Worker | None = None
        self._runner: web.AppRunner | None = None

    async def readiness(self) -> Verdict:
        worker = self.worker
        if worker is None or not worker.ready.is_set():
            return False, {"status": "starting"}
        body: dict[str, Any] = {"role": worker.role, "worker_id": worker.worker_id, "nats": worker.nc.is_connected}
        # A stage says whether its engine still serves (vLLM's engine core
        # process, the built-in engine's decode loop); asked before the
        # drain, so a worker stopping because its engine died says so.
        engine_health = getattr(worker.stage, "health", None)
        if engine_health is not None:
            try:
                await asyncio.wait_for(engine_health(), self.settings.consumer_check_timeout_s)
            except Exception as exc:
                return False, {**body, "status": "engine_dead", "error": repr(exc)}
        if worker.stopping:
            return False, {**body, "status": "draining"}
        if not worker.healthy:
            problem = worker.canary.problem if worker.canary is not None else ""
            return False, {**body, "status": "canary_failed", "error": problem}
        if worker.sleeping or worker.resting:
            return False, {**body, "status": "sleeping", "level": worker.sleeping}
        if not worker.nc.is_connected:
            return False, {**body, "status": "nats_disconnected"}
        try:
            exists = await asyncio.wait_for(
                consumer_exists(worker.js, worker.subjects, worker.role), self.settings.consumer_check_timeout_s
            )
        except Exception as exc:
            # No JetStream leader, a timeout, a reconnect in progress: the
            # worker cannot take work now, whatever the reason.
            return False, {**body, "status": "consumer_unknown", "error": repr(exc)}
        body["consumer"] = exists
        return exists, {**body, "status": "ready" if exists else "consumer_missing"}

    def liveness(self) -> Verdict:
        worker = self.worker
        if worker is None or worker.last_progress is None:
            return True, {"status": "starting"}
        if worker.stopping:
            # The fetch loop has ended on purpose; the drain has its own deadline.
            return True, {"status": "draining"}
        idle_s = time.monotonic() - worker.last_progress
        live = idle_s < self.settings.stall_after_s
        return live, {"status": "live" if live else "stuck", "since_progress_s": round(idle_s, 3)}

    # -- HTTP ------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get(READY_PATH, self._ready)
        app.router.add_get(LIVE_PATH, self._live)
        app.router.add_get(METRICS_PATH, self._metrics)
        app.router.add_post(CACHE_RESET_PATH, self._reset_cache)
        app.router.add_post(SLEEP_PATH, self._sleep)
        app.router.add_post(WAKE_UP_PATH, self._wake_up)
        app.router.add_get(IS_SLEEPING_PATH, self._is_sleeping)
        return app

    async def _sleep(self, request: web.Request) -> web.Response:
        worker = self.worker
        if worker is None or not worker.ready.is_set():
            return web.json_response({"status": "starting"}, status=503)
        try:
            level = int(request.query.get("level", "1"))
        except ValueError:
            return web.json_response({"error": "level: 1 or 2"}, status=400)
        return _state(await worker.sleep(level))

    async def _wake_up(self, request: web.Request) -> web.Response:
        worker = self.worker
        if worker is None or not worker.ready.is_set():
            return web.json_response({"status": "starting"}, status=503)
        return _state(await worker.wake_up())

    async def _is_sleeping(self, request: web.Request) -> web.Response:
        worker = self.worker
        sleeping = worker is not None and bool(worker.sleeping)
        return web.json_response({"is_sleeping": sleeping, "level": worker.sleeping if worker is not None else 0})

    async def _reset_cache(self, request: web.Request) -> web.Response:
        worker = self.worker
        if worker is None or not worker.ready.is_set():
            return web.json_response({"status": "starting"}, status=503)
        cleared = await worker.reset_prefix_cache()
        return web.json_response(msgspec.structs.asdict(cleared), status=500 if cleared.error else 200)

    async def _ready(self, request: web.Request) -> web.Response:
        ok, body = await self.readiness()
        return web.json_response(body, status=200 if ok else 503)

    async def _live(self, request: web.Request) -> web.Response:
        ok, body = self.liveness()
        return web.json_response(body, status=200 if ok else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        await before_scrape()
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def serve(self, port: int | None = None) -> int:
        """Listen on ``port`` (default: the settings'; 0 picks a free one) and
        return the port bound."""
        runner = web.AppRunner(self.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.settings.host, self.settings.port if port is None else port)
        await site.start()
        self._runner = runner
        bound: int = runner.addresses[0][1]
        log.info("health_endpoints_started", url=f"http://{self.settings.host}:{bound}")
        return bound

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
