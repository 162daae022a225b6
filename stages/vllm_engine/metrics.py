"""vLLM's scheduler and iteration stats as mmpipe's Prometheus metrics, on
the worker's ``/metrics`` beside the rest (labelled by role).

vLLM hands every stat logger passed to ``AsyncLLM.from_engine_args(
stat_loggers=...)`` its ``SchedulerStats`` (running/waiting requests, KV
cache usage, local and connector prefix-cache queries/hits) and
``IterationStats`` (prompt tokens by where they came from: computed here,
this engine's prefix cache, or an external KV transfer). The last is what
shows a decode engine's prompt came from the prefill engine through the KV
connector rather than being recomputed (``num_cached_tokens`` of a finished
request reads 0 there). vLLM calls ``record`` in the worker's own process
(its output-handler task), so the default registry is the worker's.

Those stats are not a stable vLLM interface: anything missing is skipped.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge

RUNNING = Gauge("mmpipe_vllm_running_requests", "Requests vLLM's scheduler runs", ["role"])
WAITING = Gauge("mmpipe_vllm_waiting_requests", "Requests waiting in vLLM's scheduler", ["role"])
KV_USAGE = Gauge("mmpipe_vllm_kv_cache_usage", "Fraction of vLLM's KV cache blocks in use", ["role"])
PROMPT_TOKENS = Counter(
    "mmpipe_vllm_prompt_tokens",
    "Prompt tokens vLLM prefilled, by source: local_compute, local_cache_hit, external_kv_transfer (the KV connector)",
    ["role", "source"],
)
GENERATION_TOKENS = Counter("mmpipe_vllm_generation_tokens", "Tokens vLLM generated", ["role"])
PREFIX_QUERIES = Counter(
    "mmpipe_vllm_prefix_cache_queries", "Prompt tokens looked up, by cache: local, connector", ["role", "cache"]
)
PREFIX_HITS = Counter(
    "mmpipe_vllm_prefix_cache_hits", "Prompt tokens found, by cache: local, connector", ["role", "cache"]
)
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def stat_logger_factory(role: str) -> Any:
    """A vLLM ``StatLoggerFactory`` (a class taking the vLLM config and an
    engine index) whose loggers count into the metrics above for ``role``."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class MmpipeStatLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.role = role
            for source in SOURCES:  # shown at 0 from the start
                PROMPT_TOKENS.labels(role, source)

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            if scheduler_stats is not None:
                _scheduler(self.role, scheduler_stats)
            if iteration_stats is not None:
                _iteration(self.role, iteration_stats)

        def log_engine_initialized(self) -> None:
            pass

    return MmpipeStatLogger


def _scheduler(role: str, stats: Any) -> None:
    RUNNING.labels(role).set(getattr(stats, "num_running_reqs", 0))
    WAITING.labels(role).set(getattr(stats, "num_waiting_reqs", 0))
    KV_USAGE.labels(role).set(getattr(stats, "kv_cache_usage", 0.0))
    for cache, prefix in (
        ("local", getattr(stats, "prefix_cache_stats", None)),
        ("connector", getattr(stats, "connector_prefix_cache_stats", None)),
    ):
        if prefix is not None:
            PREFIX_QUERIES.labels(role, cache).inc(getattr(prefix, "queries", 0))
            PREFIX_HITS.labels(role, cache).inc(getattr(prefix, "hits", 0))


def _iteration(role: str, stats: Any) -> None:
    GENERATION_TOKENS.labels(role).inc(getattr(stats, "num_generation_tokens", 0))
    prompt = getattr(stats, "prompt_token_stats", None)
    if prompt is None:
        return
    for source, name in zip(SOURCES, ("computed", "local_cache_hit", "external_kv_transfer"), strict=True):
        PROMPT_TOKENS.labels(role, source).inc(getattr(prompt, name, 0))
