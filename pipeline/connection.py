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
from nats.js import JetStreamContext, api
from nats.js.errors import NoStreamResponseError

from pipeline.auth import NatsAuth

log = structlog.get_logger(__name__)

# What a server says when our credentials are wrong: retrying cannot help.
_REFUSALS = ("authorization violation", "authentication", "user authentication expired")

PING_INTERVAL_S = 10
MAX_OUTSTANDING_PINGS = 3


# nats.go's JetStream publish retries "no responders" (2 more tries, 250 ms
# apart); a cluster needs it: a stream just created on other nodes takes a
# moment to be heard of by this one, and until then a publish finds nobody.
PUBLISH_RETRIES = 4
PUBLISH_RETRY_WAIT_S = 0.25


class JetStream(JetStreamContext):
    """nats-py's JetStream context, with the publish retry nats.go has.

    "No responders" means no stream took the message, so trying again
    cannot store it twice, with or without a ``Nats-Msg-Id``.
    """

    async def publish(
        self,
        subject: str,
        payload: bytes = b"",
        timeout: float | None = None,  # noqa: ASYNC109 (JetStreamContext.publish's own signature)
        stream: str | None = None,
        headers: dict[str, Any] | None = None,
        msg_ttl: float | None = None,
    ) -> api.PubAck:
        for attempt in range(PUBLISH_RETRIES + 1):
            try:
                return await super().publish(subject, payload, timeout, stream, headers, msg_ttl)
            except NoStreamResponseError:
                if attempt == PUBLISH_RETRIES:
                    raise
                log.info("jetstream_no_responders", subject=subject, attempt=attempt + 1)
                await asyncio.sleep(PUBLISH_RETRY_WAIT_S)
        raise AssertionError("unreachable")


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
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        # A caller that stopped waiting (a timeout) wants no client trying on behind it.
        connecting.cancel()
        with contextlib.suppress(BaseException):
            await connecting
        raise
    if not connecting.done():
        connecting.cancel()
        with contextlib.suppress(BaseException):
            await connecting
        raise NatsRefused(f"{', '.join(servers)} refused {name}: {refused.result()}")
    refused.cancel()
    client = connecting.result()
    connected = True
    return client, JetStream(client)


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
