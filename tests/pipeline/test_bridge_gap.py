"""The bridge relays every token exactly once even when a chunk was stored
while the bridge itself was away from NATS: after a nats-server restart a
worker may reconnect (and publish) before the bridge has, so the bridge's
subscription never sees that chunk; the reply stream has it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from pipeline.bridge.app import Bridge, BridgeSettings
from pipeline.chaos.stack import free_port
from pipeline.config import PipelineConfig
from pipeline.connection import connect
from pipeline.nats_server import NatsServer, NatsServerConfig
from pipeline.replies import ReplyPublisher
from pipeline.streams import ensure_streams
from schemas.chunk import FinishReason, TokenChunk, Usage
from schemas.codec import Decoder, encode
from schemas.control import WorkerInfo
from schemas.request import GenerateRequest


@pytest.mark.timeout(40)
async def test_a_chunk_stored_while_the_bridge_reconnects_still_reaches_the_client(tmp_path: Path) -> None:
    server = NatsServer(NatsServerConfig(data_dir=tmp_path / "nats", port=free_port()))
    config = PipelineConfig(nats_url=server.start(), namespace="gap")
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
        async with aiohttp.ClientSession() as http:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
            answer = asyncio.create_task(http.post(f"http://{host}:{port}/v1/chat/completions", json=body))
            rid = Decoder(GenerateRequest).decode((await requests.next_msg(timeout=10)).data).request_id

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
        deltas = [line for line in text.splitlines() if line.startswith("data: {")]
        assert '"content":"a"' in deltas[0] and '"content":"b"' in deltas[1], text
        assert len(deltas) == 2
    finally:
        await runner.cleanup()
        await pings.unsubscribe()
        await worker_nc.close()
        await bridge_nc.close()
        server.stop()
