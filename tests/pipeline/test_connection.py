"""A JetStream publish that finds no stream yet is retried, as nats.go does."""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.js.api import StreamConfig
from nats.js.errors import NoStreamResponseError

from pipeline.connection import PUBLISH_RETRIES, PUBLISH_RETRY_WAIT_S, connect
from pipeline.nats_server import NatsServer


async def test_a_publish_waits_for_a_stream_that_comes_up(nats_server: NatsServer, namespace: str) -> None:
    nc, js = await connect(nats_server.url, "test")
    subject, stream = f"{namespace}.late", f"{namespace}-LATE"
    try:

        async def create_late() -> None:
            await asyncio.sleep(PUBLISH_RETRY_WAIT_S * 1.5)
            await js.add_stream(StreamConfig(name=stream, subjects=[subject]))

        creating = asyncio.create_task(create_late())
        ack = await js.publish(subject, b"hello", headers={"Nats-Msg-Id": "one"})
        await creating
        assert ack.stream == stream and ack.seq == 1
        assert (await js.stream_info(stream)).state.messages == 1
    finally:
        await nc.close()


async def test_a_publish_with_no_stream_gives_up(nats_server: NatsServer, namespace: str) -> None:
    nc, js = await connect(nats_server.url, "test")
    try:
        started = time.monotonic()
        with pytest.raises(NoStreamResponseError):
            await js.publish(f"{namespace}.nobody", b"hello")
        assert time.monotonic() - started >= PUBLISH_RETRIES * PUBLISH_RETRY_WAIT_S
    finally:
        await nc.close()


async def test_a_connect_given_up_on_stops_trying() -> None:
    """`mmpipe send` gives up after --connect-timeout: nothing may go on
    trying to connect behind it."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"nats://127.0.0.1:{s.getsockname()[1]}"
    before = asyncio.all_tasks()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(connect(dead, name="test-given-up"), 0.5)
    deadline = time.monotonic() + 5
    while asyncio.all_tasks() - before:
        assert time.monotonic() < deadline, [t.get_coro() for t in asyncio.all_tasks() - before]
        await asyncio.sleep(0.05)
