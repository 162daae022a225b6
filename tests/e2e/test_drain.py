"""Drain: a decode worker process gets SIGTERM mid-stream. It stops
fetching, hands its unfinished requests back at once (nak, no delay), and
exits 0 within its grace period; the other decode worker resumes each after
the chunks already stored, so every client stream is exactly generate()'s
tokens, none of them twice."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from pipeline.config import PipelineConfig
from pipeline.connection import connect
from schemas.chunk import TokenChunk
from stages.models import ModelSpec
from tests.e2e.conftest import client, finished_reply, gradient, image_content, png_data_url, start_stack
from tests.e2e.processes import Processes

N = 256
GRACE_S = 0.1


async def _stream(c: Any, content: Any, started: asyncio.Event) -> tuple[str, str, int]:
    """(request id, text, completion tokens) of one streamed request;
    ``started`` is set once it has streamed a token."""
    s = await c.chat.completions.create(
        model="tiny-qwen2-vl",
        messages=[{"role": "user", "content": content}],
        max_tokens=N,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"min_tokens": N},
    )
    rid, text, usage = "", [], 0
    async for chunk in s:
        rid = chunk.id
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
            started.set()
        if chunk.usage:
            usage = chunk.usage.completion_tokens
    return rid, "".join(text), usage


async def _stored_chunks(js: Any, config: PipelineConfig, rid: str) -> list[TokenChunk]:
    chunks = await finished_reply(js, config.subjects, rid)
    assert all(isinstance(c, TokenChunk) for c in chunks), chunks
    return chunks  # type: ignore[return-value]


@pytest.mark.e2e
async def test_sigterm_hands_a_decode_workers_streams_to_another(
    pipeline_config: PipelineConfig, model_spec: ModelSpec, tiny_model_dir: Path, reference: Any,
    tmp_path: Path, mmpipe_home: Path,
) -> None:  # fmt: skip
    config = PipelineConfig(nats_url=pipeline_config.nats_url, namespace=pipeline_config.namespace, mode="ep-d")
    # The processor and encode+prefill in this loop; the decode workers as processes.
    stack, stop = await start_stack(config, model_spec, counts={"decode": 0})
    procs = Processes(tmp_path, mmpipe_home)
    common = ["--mode", "ep-d", "--nats-url", config.nats_url, "--namespace", config.namespace,
              "--model", str(tiny_model_dir), "--served-model-name", "tiny-qwen2-vl", "--transport", "nixl",
              "--drain-grace", str(GRACE_S)]  # fmt: skip
    leaving, staying = procs.start("worker", "decode", *common), procs.start("worker", "decode", *common)
    nc, js = await connect(config.nats_url, "test-client")
    c = client(stack, timeout=120)
    try:
        for proc in (leaving, staying):
            await asyncio.to_thread(proc.wait_for, "worker_started")
            # Ready, the process moved its start-up heap out of the collector's way.
            await asyncio.to_thread(proc.wait_for, "gc_startup_heap_frozen")
        # The staying worker sleeps until the other holds every request: its
        # pull request expires (1 s) and the server delivers to the other.
        staying.popen.send_signal(signal.SIGSTOP)
        await asyncio.sleep(1.5)
        images = [gradient(48, 40, 11), gradient(40, 56, 12)]
        contents: list[Any] = [image_content(png_data_url(im), "What is it?") for im in images] + ["Tell a story."]
        expected = [reference(x, images[i : i + 1], N)[1] for i, x in enumerate(contents)]
        started = [asyncio.Event() for _ in contents]
        streams = [asyncio.create_task(_stream(c, x, ev)) for x, ev in zip(contents, started, strict=True)]
        await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in started)), 60)
        assert not any(t.done() for t in streams), "a request finished before the drain"

        staying.popen.send_signal(signal.SIGCONT)
        sent = time.monotonic()
        leaving.popen.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(leaving.popen.wait, 30)
        exited_s = time.monotonic() - sent
        results = await asyncio.wait_for(asyncio.gather(*streams), 120)
        print(f"\ndrain: exit {code} {exited_s:.2f}s after SIGTERM (grace {GRACE_S}s)")

        assert code == 0, leaving.text()[-3000:]
        # The grace, then closing the connection, the transport and the
        # interpreter (torch, NIXL): seconds on 2 busy cores.
        assert exited_s < GRACE_S + 15.0
        assert "worker_handed_back" in leaving.text()
        assert "reply_resumed" in staying.text()
        for (rid, text, usage), want in zip(results, expected, strict=True):
            # The client's stream is exactly generate()'s: nothing repeated, nothing missing.
            assert (text, usage) == (want, N)
            # What was stored, by two workers: each token once, in order.
            stored = await _stored_chunks(js, config, rid)
            assert [c.seq for c in stored] == [0, *(c.end for c in stored[:-1])]
            assert stored[-1].end == N and stored[-1].finish_reason is not None
    finally:
        await c.close()
        await nc.close()
        await asyncio.to_thread(procs.stop_all)
        await stop()
