"""SGLang's load and token counts as mmpipe's Prometheus metrics, on the
worker's ``/metrics`` beside the rest (labelled by role), named as the vLLM
engine's are (``mmpipe_vllm_*``) where they mean the same.

The load (running and waiting requests, the share of the KV pool in use)
comes from SGLang's own load snapshots (``TokenizerManager.get_loads``,
what its ``/v1/loads`` serves), read once a second while the engine runs.
The tokens come from each request's last output (``meta_info``: its
prompt tokens, those RadixAttention held, the tokens generated), counted
as the request ends, finished or aborted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import Counter, Gauge

RUNNING = Gauge("mmpipe_sglang_running_requests", "Requests SGLang's scheduler runs", ["role"])
WAITING = Gauge("mmpipe_sglang_waiting_requests", "Requests waiting in SGLang's scheduler", ["role"])
KV_USAGE = Gauge("mmpipe_sglang_kv_cache_usage", "Fraction of SGLang's KV pool (tokens) in use", ["role"])
PROMPT_TOKENS = Counter(
    "mmpipe_sglang_prompt_tokens",
    "Prompt tokens of SGLang's requests, by source: local_compute, local_cache_hit (RadixAttention)",
    ["role", "source"],
)
GENERATION_TOKENS = Counter("mmpipe_sglang_generation_tokens", "Tokens SGLang generated", ["role"])
SOURCES = ("local_compute", "local_cache_hit")


def declare(role: str) -> None:
    """Every series shown at 0 from the engine's start."""
    for source in SOURCES:
        PROMPT_TOKENS.labels(role, source)
    GENERATION_TOKENS.labels(role)
    for gauge in (RUNNING, WAITING, KV_USAGE):
        gauge.labels(role).set(0)


def record_load(role: str, loads: list[Any]) -> None:
    """SGLang's load snapshots (one a data-parallel rank), summed."""
    RUNNING.labels(role).set(sum(int(getattr(load, "num_running_reqs", 0)) for load in loads))
    WAITING.labels(role).set(sum(int(getattr(load, "num_waiting_reqs", 0)) for load in loads))
    used = sum(int(getattr(load, "num_used_tokens", 0)) for load in loads)
    total = sum(int(getattr(load, "max_total_num_tokens", 0)) for load in loads)
    KV_USAGE.labels(role).set(used / total if total else 0.0)


def record_request(role: str, meta: Mapping[str, Any]) -> None:
    """One request's counts from its last output's ``meta_info``."""
    prompt = int(meta.get("prompt_tokens") or 0)
    cached = min(int(meta.get("cached_tokens") or 0), prompt)
    PROMPT_TOKENS.labels(role, "local_compute").inc(prompt - cached)
    PROMPT_TOKENS.labels(role, "local_cache_hit").inc(cached)
    GENERATION_TOKENS.labels(role).inc(int(meta.get("completion_tokens") or 0))
