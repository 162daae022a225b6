"""Connecting to NATS: reconnect forever, log every state change."""

from __future__ import annotations

import nats
import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext

log = structlog.get_logger(__name__)


async def connect(url: str, name: str) -> tuple[Client, JetStreamContext]:
    servers = [u.strip() for u in url.split(",") if u.strip()]

    async def on_error(error: Exception) -> None:
        log.warning("nats_error", client=name, error=repr(error))

    async def on_disconnected() -> None:
        log.warning("nats_disconnected", client=name)

    async def on_reconnected() -> None:
        log.info("nats_reconnected", client=name, server=nc.connected_url.netloc if nc.connected_url else None)

    nc = await nats.connect(
        servers=servers,
        name=name,
        # A worker outlives a nats-server restart: keep trying, never give up.
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        allow_reconnect=True,
        connect_timeout=5,
        error_cb=on_error,
        disconnected_cb=on_disconnected,
        reconnected_cb=on_reconnected,
    )
    return nc, nc.jetstream()


async def shutdown(nc: Client) -> None:
    """Drain when connected (flushes pending publishes and acks); a client
    that is reconnecting cannot drain, so it just closes."""
    if nc.is_connected:
        try:
            await nc.drain()
            return
        except Exception as exc:
            log.warning("nats_drain_failed", error=repr(exc))
    await nc.close()
