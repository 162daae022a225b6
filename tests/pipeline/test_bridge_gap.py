"""The bridge relays every token exactly once even when a chunk never
reached its subscription, from the reply stream, which stores every chunk:
after a nats-server restart a worker may reconnect (and publish) before the
bridge has; a chunk that is stored but not delivered to the bridge leaves,
when it is the last, no later chunk to show the gap."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import StreamSource, SubjectTransform
from prometheus_client import REGISTRY

from pipeline.bridge.app import Bridge, BridgeSettings
from pipeline.chaos.stack import free_port
from pipeline.config import PipelineConfig
from pipeline.connection import connect
from pipeline.nats_server import NatsServer, NatsServerConfig
from pipeline.replies import ReplyPublisher
from pipeline.streams import ensure_streams
from schemas.chunk import FinishReason, TokenChunk, Usage
from schemas.codec import CONTENT_TYPE, MSGPACK, Decoder, encode
from schemas.control import WorkerInfo
from schemas.request import GenerateRequest

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}


@dataclass
class Setup:
    server: NatsServer
    config: PipelineConfig
    worker_nc: Client
    worker_js: JetStreamContext
    bridge_nc: Client
    # What the bridge queues, as a worker would take it.
    requests: Subscription
    url: str

    async def next_request_id(self) -> str:
        return Decoder(GenerateRequest).decode((await self.requests.next_msg(timeout=10)).data).request_id


@contextlib.asynccontextmanager
async def bridge_and_worker(tmp_path: Path, namespace: str) -> AsyncIterator[Setup]:
    """A real bridge on a real nats-server, and the NATS side of a worker
    (answering the bridge's pings, reading its requests) that the test drives."""
    server = NatsServer(NatsServerConfig(data_dir=tmp_path / "nats", port=free_port()))
    config = PipelineConfig(nats_url=server.start(), namespace=namespace)
    s = config.subjects
    worker_nc, worker_js = await connect(config.nats_url, "test-worker")
    bridge_nc, bridge_js = await connect(config.nats_url, "test-bridge")
    await ensure_streams(worker_js, config)
    info = encode(WorkerInfo(role="processor", worker_id="p", models=["m"], inflight=0, max_inflight=1))

    async def pong(msg: Msg) -> None:
        await msg.respond(info)

    pings = await worker_nc.subscribe(s.ping("processor"), cb=pong)
    requests = await worker_nc.subscribe(s.requests)
    runner = web.AppRunner(Bridge(bridge_nc, bridge_js, config, BridgeSettings()).app(), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield Setup(server, config, worker_nc, worker_js, bridge_nc, requests, f"http://{host}:{port}")
    finally:
        await runner.cleanup()
        await pings.unsubscribe()
        await worker_nc.close()
        await bridge_nc.close()
        server.stop()


def deltas(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("data: {")]


@pytest.mark.timeout(40)
async def test_a_chunk_stored_while_the_bridge_reconnects_still_reaches_the_client(tmp_path: Path) -> None:
    async with bridge_and_worker(tmp_path, "gap") as setup:
        server, s, worker_nc, worker_js, bridge_nc = (
            setup.server, setup.config.subjects, setup.worker_nc, setup.worker_js, setup.bridge_nc,
        )  # fmt: skip
        async with aiohttp.ClientSession() as http:
            answer = asyncio.create_task(http.post(f"{setup.url}/v1/chat/completions", json=BODY))
            rid = await setup.next_request_id()

            # The server goes away and comes back; the worker is back first and
            # stores token 0 before the bridge has reconnected.
            bridge_nc.options["reconnect_time_wait"] = 8.0  # the bridge stays away a little longer
            server.stop()
            server.start()
            replies = ReplyPublisher(worker_nc, worker_js, s)
            for _ in range(100):
                if worker_nc.is_connected:
                    break
                await asyncio.sleep(0.01)
            for _ in range(60):  # JetStream takes a moment to recover its streams
                try:
                    async with asyncio.timeout(0.5):
                        await replies.publish(s.reply(rid), TokenChunk(rid, 0, [11], "a"))
                    break
                except (TimeoutError, NatsTimeoutError, NoRespondersError):
                    await asyncio.sleep(0.05)
            assert not bridge_nc.is_connected, "the bridge came back too soon to miss anything"
            for _ in range(750):
                if bridge_nc.is_connected:
                    break
                await asyncio.sleep(0.02)
            assert bridge_nc.is_connected
            await asyncio.sleep(0.2)
            last = TokenChunk(rid, 1, [12], "b", finish_reason=FinishReason.LENGTH, usage=Usage(1, 2))
            await replies.publish(s.reply(rid), last)
            async with asyncio.timeout(15):
                response = await answer
                text = await response.text()
        assert response.status == 200, text
        got = deltas(text)
        assert '"content":"a"' in got[0] and '"content":"b"' in got[1], text
        assert len(got) == 2


@pytest.mark.timeout(40)
async def test_a_last_chunk_the_bridges_subscription_never_saw_reaches_the_client(tmp_path: Path) -> None:
    """The final chunk is stored in the reply stream but never delivered to
    the bridge (sourced there from another stream, so no subscriber sees it
    published, as a message lost on its way): nothing after it shows a gap,
    and the bridge reads it back once the reply has been silent a while,
    not at the request's deadline (five minutes)."""

    def recovered() -> float:
        return REGISTRY.get_sample_value("mmpipe_reply_chunks_recovered_total", {"why": "silence"}) or 0.0

    async with bridge_and_worker(tmp_path, "silent") as setup:
        s, js = setup.config.subjects, setup.worker_js
        await js.add_stream(name="side", subjects=["side.*"])
        reply = (await js.stream_info(s.reply_stream)).config
        reply.sources = [
            StreamSource(name="side", subject_transforms=[SubjectTransform("side.*", s.reply("{{wildcard(1)}}"))])
        ]
        await js.update_stream(reply)
        before = recovered()
        async with aiohttp.ClientSession() as http:
            answer = asyncio.create_task(http.post(f"{setup.url}/v1/chat/completions", json=BODY))
            rid = await setup.next_request_id()
            await ReplyPublisher(setup.worker_nc, js, s).publish(s.reply(rid), TokenChunk(rid, 0, [11], "a"))
            last = TokenChunk(rid, 1, [12], "b", finish_reason=FinishReason.LENGTH, usage=Usage(1, 2))
            await js.publish(f"side.{rid}", encode(last), headers={CONTENT_TYPE: MSGPACK})
            async with asyncio.timeout(20):
                response = await answer
                text = await response.text()
        assert response.status == 200, text
        got = deltas(text)
        assert len(got) == 2 and '"content":"a"' in got[0] and '"content":"b"' in got[1], text
        assert '"finish_reason":"length"' in got[1], text
        assert recovered() == before + 1
