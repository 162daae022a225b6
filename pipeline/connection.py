"""Connecting to NATS: reconnect forever, log every state change, but give
up at once when the server refuses us."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from typing import Any

import nats
import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext

from pipeline.auth import NatsAuth

log = structlog.get_logger(__name__)

# What a server says when our credentials are wrong: retrying cannot help.
_REFUSALS = ("authorization violation", "authentication", "user authentication expired")

PING_INTERVAL_S = 10
MAX_OUTSTANDING_PINGS = 3


class NatsRefused(ConnectionError):
    """The NATS server refused this client's credentials or TLS."""


def _is_refusal(error: Exception) -> bool:
    return isinstance(error, ssl.SSLError) or any(r in str(error).lower() for r in _REFUSALS)


async def connect(url: str, name: str, auth: NatsAuth | None = None) -> tuple[Client, JetStreamContext]:
    """``url`` is one server URL or several comma separated (the nodes of a
    cluster, in any order): the client picks one, learns the rest of the
    cluster from it, and on losing its node reconnects to another.
    ``auth`` defaults to the ``MMPIPE_NATS_*`` environment.

    While no server answers (a worker started before NATS, or across a
    restart) this keeps trying; a refusal of the credentials or of TLS on the
    first connect raises ``NatsRefused`` instead: nats-py would otherwise
    retry it forever and the process would hang saying nothing useful.
    """
    auth = auth if auth is not None else NatsAuth.from_env()
    servers = [u.strip() for u in url.split(",") if u.strip()]
    refused: asyncio.Future[Exception] = asyncio.get_running_loop().create_future()
    connected = False

    async def on_error(error: Exception) -> None:
        log.warning("nats_error", client=name, error=repr(error))
        if not connected and not refused.done() and _is_refusal(error):
            refused.set_result(error)

    async def on_disconnected() -> None:
        log.warning("nats_disconnected", client=name)

    async def on_reconnected() -> None:
        server = client.connected_url.netloc if client.connected_url else None
        log.info("nats_reconnected", client=name, server=server)

    connecting = asyncio.ensure_future(
        nats.connect(
            servers=servers,
            name=name,
            # A worker outlives a nats-server restart: keep trying, never give up.
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            allow_reconnect=True,
            connect_timeout=5,
            # A node that dies outright closes the socket and the client moves
            # to another at once; one cut off silently (a host or network
            # failure) is noticed after this many unanswered pings.
            ping_interval=PING_INTERVAL_S,
            max_outstanding_pings=MAX_OUTSTANDING_PINGS,
            error_cb=on_error,
            disconnected_cb=on_disconnected,
            reconnected_cb=on_reconnected,
            **auth.connect_options(),
        )
    )
    waits: set[asyncio.Future[Any]] = {connecting, refused}
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    if not connecting.done():
        connecting.cancel()
        with contextlib.suppress(BaseException):
            await connecting
        raise NatsRefused(f"{', '.join(servers)} refused {name}: {refused.result()}")
    refused.cancel()
    client = connecting.result()
    connected = True
    return client, client.jetstream()


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
