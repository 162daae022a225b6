"""Prometheus metrics of the tensor transports (one set per process)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

BYTES = Counter("mmpipe_tensor_bytes_total", "Tensor bytes put and got", ["transport", "direction"])
TRANSFER_SECONDS = Histogram(
    "mmpipe_tensor_transfer_seconds", "Time of one get, lookups included", ["transport"], buckets=_SECONDS
)
HELD_BYTES = Gauge("mmpipe_tensor_held_bytes", "Bytes held for readers", ["transport"])
EXPIRED = Counter("mmpipe_tensor_expired_total", "Held regions freed by TTL, never read", ["transport"])
ERRORS = Counter("mmpipe_tensor_errors_total", "Transport failures by reason", ["transport", "reason"])
