"""The built-in engine's KV pool as Prometheus metrics, on the worker's
``/metrics`` beside the rest (named as vLLM's: usage and preemptions)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

KV_USAGE = Gauge("mmpipe_kv_cache_usage", "Fraction of the KV pool's blocks held by sequences")
PREEMPTIONS = Counter("mmpipe_preemptions_total", "Running sequences swapped out of the KV pool to let older ones grow")
