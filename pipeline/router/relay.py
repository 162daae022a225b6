"""A worker's KV events relayed from its ZMQ publisher onto NATS
(``mmpipe.<ns>.kv_events.<worker_id>``), as NVIDIA Dynamo relays vLLM's:
the same msgpack batches, whichever engine published them (the built-in
one, in the worker or its engine core process, or vLLM's own)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import structlog
from nats.aio.client import Client

from pipeline.kv_events import binds

log = structlog.get_logger(__name__)


def subscribe_endpoint(endpoint: str) -> str | None:
    """Where a subscriber on this host reaches a publisher bound at
    ``endpoint``; None for one that connects out (to a broker elsewhere)."""
    if not binds(endpoint):
        return None
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:", "tcp://[::]:"):
        if endpoint.startswith(wildcard):
            return "tcp://127.0.0.1:" + endpoint.removeprefix(wildcard)
    return endpoint


class KvEventRelay:
    def __init__(
        self,
        nc: Client,
        endpoint: str,
        subject: str,
        topic: str = "",
        rewrite: Callable[[bytes], bytes | None] | None = None,
    ) -> None:
        self.nc = nc
        self.endpoint = endpoint
        self.subject = subject
        self.topic = topic
        # A batch as the router reads it (vLLM's hashes as mmpipe's keys); None from it: nothing to relay.
        self.rewrite = rewrite
        self.relayed = 0
        self._task: asyncio.Task[None] | None = None
        self._socket: Any = None

    def start(self) -> bool:
        """Start relaying; False where the endpoint is not one to subscribe to here."""
        where = subscribe_endpoint(self.endpoint)
        if where is None:
            log.warning("kv_events_not_relayed", endpoint=self.endpoint, why="the publisher connects out")
            return False
        import zmq
        import zmq.asyncio

        self._socket = zmq.asyncio.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        self._socket.connect(where)
        self._task = asyncio.create_task(self._run())
        log.info("kv_events_relaying", endpoint=where, subject=self.subject)
        return True

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._socket is not None:
            self._socket.close(linger=0)

    async def _run(self) -> None:
        while True:
            frames = await self._socket.recv_multipart()
            if len(frames) != 3:
                log.warning("kv_events_bad_frames", frames=len(frames))
                continue
            _, seq, raw = frames
            try:
                payload = raw if self.rewrite is None else self.rewrite(raw)
            except Exception as exc:  # one batch unread: the router knows less, nothing breaks
                log.warning("kv_events_rewrite_failed", error=repr(exc))
                continue
            if payload is None:
                continue
            try:
                await self.nc.publish(self.subject, payload, headers={"Mmpipe-Seq": str(int.from_bytes(seq, "big"))})
                self.relayed += 1
            except Exception as exc:  # reconnecting: a router resynchronises on a gap
                log.warning("kv_events_relay_failed", error=repr(exc))
