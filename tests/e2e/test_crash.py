"""A KV holder killed outright: the prefill worker process is SIGKILLed after
it handed its KV cache on and before any decode worker read it. The decode
worker finds the holder gone, the request restarts from its first hop, and
the client still gets exactly generate()'s tokens."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from pipeline.config import PipelineConfig
from pipeline.connection import connect
from pipeline.replies import CHUNK_DECODER
from pipeline.streams import ensure_streams
from schemas.chunk import TokenChunk
from schemas.codec import encode
from schemas.request import ChatMessage, GenerateRequest, ImagePart, ImageURL, SamplingParams, TextPart
from tests.e2e.conftest import gradient, png_data_url
from tests.e2e.processes import Processes

N = 10


@pytest.mark.e2e
async def test_prefill_worker_killed_holding_the_kv_cache(
    pipeline_config: PipelineConfig, tmp_path: Path, mmpipe_home: Path, tiny_model_dir: Path, reference: Any
) -> None:
    config = PipelineConfig(nats_url=pipeline_config.nats_url, namespace="default", mode="e-p-d")
    subjects = config.subjects
    procs = Processes(tmp_path, mmpipe_home)
    nc, js = await connect(config.nats_url, "test-client")
    try:
        await ensure_streams(js, config)
        # No decode worker yet: the KV cache stays with the prefill worker.
        starting = [procs.worker(role, config.nats_url, "e-p-d", tiny_model_dir) for role in ("processor", "encode")]
        prefill = procs.worker("prefill", config.nats_url, "e-p-d", tiny_model_dir)
        for proc in [*starting, prefill]:
            await asyncio.to_thread(proc.wait_for, "worker_started")

        image = gradient(64, 48, 1)
        content = [ImagePart(ImageURL(png_data_url(image))), TextPart("What is it?")]
        request = GenerateRequest(
            "killed-kv",
            "tiny-qwen2-vl",
            [ChatMessage("user", content)],
            SamplingParams(max_tokens=N, min_tokens=N, temperature=0.0),
        )
        sub = await nc.subscribe(subjects.reply("killed-kv"))
        await js.publish(subjects.requests, encode(request))
        decode_queue = subjects.stream("decode")
        for _ in range(600):
            if (await js.stream_info(decode_queue)).state.messages == 1:
                break
            await asyncio.sleep(0.05)
        assert (await js.stream_info(decode_queue)).state.messages == 1
        prefill.kill()

        decode = procs.worker("decode", config.nats_url, "e-p-d", tiny_model_dir)
        procs.worker("prefill", config.nats_url, "e-p-d", tiny_model_dir)
        tokens: list[int] = []
        while True:
            chunk = CHUNK_DECODER.decode((await sub.next_msg(timeout=120)).data)
            assert isinstance(chunk, TokenChunk), chunk
            tokens += chunk.token_ids
            if chunk.finish_reason is not None:
                break
        parts = [{"type": "image_url", "image_url": {"url": ""}}, {"type": "text", "text": "What is it?"}]
        assert tokens == reference(parts, [image], N)[0]
        assert "restarting_from_first_hop" in decode.text()
    finally:
        await nc.close()
        await asyncio.to_thread(procs.stop_all)
