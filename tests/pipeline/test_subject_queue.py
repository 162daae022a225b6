"""SubjectQueue: a subject's messages read one at a time, in order, under
the reader's timeout, and none after it unsubscribed."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pipeline.subject_queue import SubjectQueue


async def test_messages_come_in_order_and_a_wait_with_none_times_out(nats_client: Any, namespace: str) -> None:
    nc, _ = nats_client
    subject = f"{namespace}.reply.r1"
    queue = await SubjectQueue.open(nc, subject)
    try:
        for i in range(5):
            await nc.publish(subject, str(i).encode())
        await nc.publish(f"{namespace}.reply.r2", b"another request's")
        got = []
        for _ in range(5):
            async with asyncio.timeout(10):
                got.append((await queue.get()).data)
        assert got == [b"0", b"1", b"2", b"3", b"4"]
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await queue.get()
    finally:
        await queue.unsubscribe()


async def test_nothing_arrives_once_unsubscribed(nats_client: Any, namespace: str) -> None:
    nc, _ = nats_client
    subject = f"{namespace}.reply.r3"
    queue = await SubjectQueue.open(nc, subject)
    await queue.unsubscribe()
    await nc.publish(subject, b"late")
    await nc.flush()  # the server has had the message, and would have sent it by now
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.3):
            await queue.get()
