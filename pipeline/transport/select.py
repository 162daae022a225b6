"""Choosing the tensor transport of a process.

"nixl" is what a deployment should run; "nats" works anywhere NATS does;
"auto" takes NIXL when it is installed and starts, and otherwise falls back
to NATS with a warning, so a laptop without NIXL still runs the pipeline.
"""

from __future__ import annotations

import structlog
import torch
from nats.aio.client import Client
from nats.js import JetStreamContext

from pipeline.transport import metrics
from pipeline.transport.base import TensorTransport, TransportSettings, TransportUnavailable
from pipeline.transport.nats_store import NatsTransport
from pipeline.transport.nixl import NixlTransport

log = structlog.get_logger(__name__)

TRANSPORTS = ("auto", "nixl", "nats")


async def open_transport(
    kind: str,
    nc: Client,
    js: JetStreamContext,
    namespace: str,
    settings: TransportSettings | None = None,
    role: str = "worker",
    device: torch.device | str = "cpu",
) -> TensorTransport:
    """A started transport of ``kind``. An explicit "nixl" fails when NIXL
    cannot run here; "auto" then falls back to "nats"."""
    if kind not in TRANSPORTS:
        raise ValueError(f"unknown tensor transport {kind!r}; choose one of {', '.join(TRANSPORTS)}")
    if kind in ("auto", "nixl"):
        nixl: NixlTransport | None = None
        try:
            nixl = NixlTransport(nc, js, namespace, settings, role, device)
            await nixl.start()
            return nixl
        except BaseException as exc:
            if nixl is not None:
                await nixl.close()  # a half-started agent holds a thread and maybe a subscription
            if kind == "nixl" or not isinstance(exc, TransportUnavailable):
                raise
            metrics.ERRORS.labels("nixl", "unavailable").inc()
            log.warning("tensor_transport_fallback", wanted="nixl", using="nats", reason=exc.message)
    nats_transport = NatsTransport(nc, js, namespace, settings, role, device)
    await nats_transport.start()
    return nats_transport
