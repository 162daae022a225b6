"""Tensor transport: large tensors move between workers out of band.

A worker ``put``s tensors and sends the small ``TensorRef`` it gets back in
its NATS message; the next worker ``get``s them. NIXL (UCX, one-sided READ)
is the transport; the NATS object store is the fallback for hosts without
NIXL. ``open_transport`` picks one.
"""

from typing import TYPE_CHECKING, Any

from pipeline.transport.base import (
    ForeignTensorRef,
    TensorGone,
    TensorTransport,
    TransportFull,
    TransportSettings,
    TransportUnavailable,
)

if TYPE_CHECKING:
    from pipeline.transport.select import TRANSPORTS, open_transport


def __getattr__(name: str) -> Any:
    # Lazy: the implementations import torch (and NIXL), which the bridge and
    # the processor, importing this package for its errors, never need.
    if name in ("TRANSPORTS", "open_transport"):
        from pipeline.transport import select

        return getattr(select, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "TRANSPORTS",
    "ForeignTensorRef",
    "TensorGone",
    "TensorTransport",
    "TransportFull",
    "TransportSettings",
    "TransportUnavailable",
    "open_transport",
]
