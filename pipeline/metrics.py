"""Prometheus metrics of one process. Names follow ``mmpipe_<what>_<unit>``."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Iterator

import structlog
from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector, CollectorRegistry

log = structlog.get_logger(__name__)

_LATENCY = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

MESSAGES = Counter("mmpipe_messages_total", "Messages handled by a worker, by outcome", ["role", "outcome"])
ERRORS = Counter("mmpipe_errors_total", "Errors by where they happened and their code", ["where", "code"])
QUEUE_WAIT = Histogram("mmpipe_queue_wait_seconds", "Time a message waited in its stream", ["role"], buckets=_LATENCY)
STAGE_TIME = Histogram("mmpipe_stage_seconds", "Time a worker spent on a message", ["role"], buckets=_LATENCY)
INFLIGHT = Gauge("mmpipe_inflight", "Messages a worker is working on", ["role"])
TOKENS = Counter("mmpipe_generated_tokens_total", "Tokens generated", ["role"])
PROMPT_TOKENS = Counter("mmpipe_prompt_tokens_total", "Prompt tokens prefilled", ["role"])
TTFT = Histogram("mmpipe_time_to_first_token_seconds", "Request created to first token", ["where"], buckets=_LATENCY)
ITL = Histogram("mmpipe_inter_token_latency_seconds", "Time between chunks of one request", ["where"], buckets=_LATENCY)
E2E = Histogram("mmpipe_request_seconds", "Request created to last chunk", ["where"], buckets=_LATENCY)
CANARY_SECONDS = Histogram(
    "mmpipe_canary_seconds", "Time a worker's canary health check took", ["role"], buckets=_LATENCY
)
CANARY_FAILURES = Counter(
    "mmpipe_canary_failures_total", "Canary health checks that failed, by reason (error, timeout)", ["role", "reason"]
)
HTTP_REQUESTS = Counter("mmpipe_http_requests_total", "Bridge HTTP requests by status", ["path", "status"])
DEAD = Counter("mmpipe_dead_letters_total", "Messages recorded on the dead subject", ["role", "code"])
REPLY_CHUNKS_RECOVERED = Counter(
    "mmpipe_reply_chunks_recovered_total",
    "Reply chunks the bridge read back from the reply stream, not from its subscription, by what made it look",
    ["why"],
)
RESTARTS = Counter("mmpipe_restarts_total", "Requests restarted from their first hop (a tensor was gone)", ["role"])
BACKPRESSURE = Counter(
    "mmpipe_backpressure_waits_total",
    "Waits for room (to fetch, or in a full next-hop queue), by reason",
    ["role", "reason"],
)
_GBPS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
HOP_TENSOR_BYTES = Counter("mmpipe_hop_tensor_bytes_total", "Tensor bytes a hop put or got", ["role", "direction"])
HOP_TRANSFER_SECONDS = Histogram(
    "mmpipe_hop_transfer_seconds", "Time of a hop's tensor put or get", ["role", "direction"], buckets=_LATENCY
)
HOP_TRANSFER_GBPS = Histogram(
    "mmpipe_hop_transfer_gbps", "Throughput of a hop's tensor put or get, GB/s", ["role", "direction"], buckets=_GBPS
)


class ThreadCpu(Collector):
    """``mmpipe_thread_cpu_seconds_total{thread}``: CPU time of each live
    Python thread of this process, by its name. Beside
    ``process_cpu_seconds_total`` it tells a process whose threads together
    hold about one core (one GIL shared, each waiting for the others) from
    one whose single thread is busy."""

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "mmpipe_thread_cpu_seconds", "CPU time of each live Python thread, by name", labels=["thread"]
        )
        by_name: dict[str, float] = {}
        for thread in threading.enumerate():
            if thread.ident is None:
                continue
            try:
                seconds = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
            except (OSError, AttributeError):  # the thread just ended; no such clock on this OS
                continue
            # Pools name their threads by pool and index: each its own series.
            by_name[thread.name] = by_name.get(thread.name, 0.0) + seconds
        for name, seconds in sorted(by_name.items()):
            family.add_metric([name], seconds)
        yield family


REGISTRY.register(ThreadCpu())


# Families both processes have that say something of each process: the
# core's are shown under mmpipe_engine_core_<name> (its other twins, the
# worker-side families it imports but never moves, are left out).
_CORE_TWINS = ("mmpipe_thread_cpu_seconds", "process_cpu_seconds", "process_resident_memory_bytes")
_CORE_PREFIX = "mmpipe_engine_core_"
# How long a scrape waits for the core's exposition before it shows the last one.
_CORE_SCRAPE_S = 2.0


class EngineCoreMetrics(Collector):
    """The engine core process's metrics (``--engine-process``) on the
    worker's /metrics: its engine, pool and step families as they are, and
    its thread and process CPU as ``mmpipe_engine_core_*``. Fetched from the
    core before each scrape (``refresh``)."""

    def __init__(self, scrape: Callable[[], Awaitable[bytes]], registry: CollectorRegistry = REGISTRY) -> None:
        self._scrape = scrape
        self._registry = registry
        self._text = ""

    async def refresh(self) -> None:
        try:
            self._text = (await asyncio.wait_for(self._scrape(), _CORE_SCRAPE_S)).decode()
        except Exception as exc:
            log.warning("engine_core_scrape_failed", error=repr(exc))

    def collect(self) -> Iterator[Metric]:
        # What this process registers itself (a private map, read-only here).
        own = set(self._registry._names_to_collectors)
        for family in text_string_to_metric_families(self._text):
            if family.name in _CORE_TWINS:
                yield _renamed(family, _CORE_PREFIX + family.name.removeprefix("mmpipe_"))
            elif family.name not in own:
                yield family


def _renamed(family: Metric, name: str) -> Metric:
    out = Metric(name, family.documentation, family.type, family.unit)
    for sample in family.samples:
        out.add_sample(name + sample.name[len(family.name) :], sample.labels, sample.value, sample.timestamp)
    return out


_BEFORE_SCRAPE: list[EngineCoreMetrics] = []


def show_engine_core(
    scrape: Callable[[], Awaitable[bytes]], registry: CollectorRegistry = REGISTRY
) -> Callable[[], None]:
    """The core's metrics on this process's /metrics until the returned call."""
    collector = EngineCoreMetrics(scrape, registry)
    registry.register(collector)
    _BEFORE_SCRAPE.append(collector)

    def hide() -> None:
        _BEFORE_SCRAPE.remove(collector)
        registry.unregister(collector)

    return hide


async def before_scrape() -> None:
    """Bring what other processes show here up to date (the engine core's)."""
    for collector in list(_BEFORE_SCRAPE):
        await collector.refresh()
