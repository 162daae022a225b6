"""Tensor transport: large tensors move between workers out of band.

A worker ``put``s tensors and sends the small ``TensorRef`` it gets back in
its NATS message; the next worker ``get``s them. NIXL (UCX, one-sided READ)
is the transport; the NATS object store is the fallback for hosts without
NIXL. ``open_transport`` picks one.
"""

from pipeline.transport.base import (
    TensorGone,
    TensorTransport,
    TransportFull,
    TransportSettings,
    TransportUnavailable,
)
from pipeline.transport.select import TRANSPORTS, open_transport

__all__ = [
    "TRANSPORTS",
    "TensorGone",
    "TensorTransport",
    "TransportFull",
    "TransportSettings",
    "TransportUnavailable",
    "open_transport",
]
