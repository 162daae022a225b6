"""A vLLM decode worker killed mid-stream (E/P/D, KV by ExampleConnector):
the worker process and its vLLM engine-core children are SIGKILLed after the
client got a few tokens. The other decode worker takes the request over once
the message's ack wait runs out (the image's embeddings were read by the dead
worker: the request restarts from its first hop, whose prefill covers the
prompt plus the tokens the client holds) and the reply stream ends with
exactly generate()'s tokens, each once, seq in order.

Workers started one by one (``mmpipe up`` stops the whole deployment when
one of its children dies)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from pipeline.connection import connect
from pipeline.replies import stored_chunks
from pipeline.subjects import Subjects
from schemas.chunk import TokenChunk
from schemas.codec import CONTENT_TYPE, MSGPACK, encode
from tests.e2e.conftest import gradient, make_reference
from tests.e2e.processes import Proc, Processes
from tests.vllm.test_vllm_engine import ENGINE_ARGS, MODEL, image_request

N = 300
MODE = "e-p-d"


def _kill_tree(proc: Proc) -> None:
    """SIGKILL a worker and vLLM's engine-core processes under it, as a
    container's death would."""
    parent = psutil.Process(proc.popen.pid)
    for child in parent.children(recursive=True):
        child.kill()
    proc.kill()


@pytest.mark.e2e
@pytest.mark.timeout(600)  # five workers, three vLLM engines, started within the test
async def test_killed_vllm_decode_worker_request_completes_on_the_other(
    tmp_path: Path, mmpipe_home: Path, vllm_model_dir: Path
) -> None:
    procs = Processes(tmp_path, mmpipe_home)
    args_file = tmp_path / "engine-args.json"
    args_file.write_text(json.dumps(ENGINE_ARGS))
    try:
        nats = procs.start("nats", "--data-dir", str(tmp_path / "data"), "--port", "0")
        await asyncio.to_thread(nats.wait_for, "nats-server ready", 60)
        found = re.search(r"nats-server ready: (\S+)", nats.text())
        assert found is not None
        nats_url = found.group(1)
        common = ["--mode", MODE, "--nats-url", nats_url, "--model", str(vllm_model_dir)]
        # A short ack wait: the dead worker's message goes to the other one in
        # seconds; a short drain: nothing is in flight at the end.
        common += ["--served-model-name", MODEL, "--transport", "nats", "--ack-wait", "6", "--drain-grace", "2"]
        vllm = ["--engine", "vllm", "--vllm-args-file", str(args_file), "--vllm-arg", "max_model_len=2048"]
        vllm += ["--vllm-kv-connector", "example", "--vllm-kv-path", str(tmp_path / "kv")]
        workers = [procs.start("worker", role, *common) for role in ("processor", "encode")]
        workers.append(procs.start("worker", "prefill", *common, *vllm))
        decoders = [procs.start("worker", "decode", *common, *vllm) for _ in range(2)]
        for proc in [*workers, *decoders]:
            await asyncio.to_thread(proc.wait_for, "worker_started", 300)

        image = gradient(64, 48, 5)
        rid = "killed-vllm-decode"
        request = image_request(rid, image, N)
        subjects = Subjects("default")
        nc, js = await connect(nats_url, name="test-crash")
        try:
            await js.publish(subjects.requests, encode(request), headers={CONTENT_TYPE: MSGPACK, "Nats-Msg-Id": rid})
            # Deadlines, not counts: a fresh vLLM engine's first forward on a
            # busy 2-core machine took over 20 s.
            held: list[TokenChunk] = []
            deadline = time.monotonic() + 240
            while len(held) < 3 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
                held = [c for c in await stored_chunks(js, subjects, rid) if isinstance(c, TokenChunk)]
            assert len(held) >= 3, [d.text()[-2000:] for d in decoders]
            first = next(d for d in decoders if _decode_starts(d, rid))
            _kill_tree(first)
            other = decoders[1 - decoders.index(first)]
            assert len(held) < N  # killed mid-stream
            chunks: list[TokenChunk] = []
            deadline = time.monotonic() + 300
            while not (chunks and chunks[-1].finish_reason is not None) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
                chunks = [c for c in await stored_chunks(js, subjects, rid) if isinstance(c, TokenChunk)]
        finally:
            await nc.close()
        assert [c.seq for c in chunks] == list(range(N))  # each token once, in order
        content: list[dict[str, Any]] = [
            {"type": "image_url", "image_url": {"url": ""}},
            {"type": "text", "text": "What is in the picture?"},
        ]
        expected, _ = make_reference(vllm_model_dir)(content, [image], N)
        assert [t for c in chunks for t in c.token_ids] == expected
        # The other worker continued after the tokens the client held.
        assert any(e["resumed"] >= len(held) for e in _decode_starts(other, rid)), other.text()[-3000:]
    finally:
        for proc in procs.procs:  # all at once: each vLLM engine takes seconds to stop
            if proc.popen.poll() is None:
                proc.popen.terminate()
        await asyncio.to_thread(procs.stop_all)


def _decode_starts(proc: Proc, rid: str) -> list[dict[str, Any]]:
    """The worker's vllm_decode_started events of request ``rid``."""
    events = [json.loads(line) for line in proc.text().splitlines() if line.startswith("{") and "vllm_decode" in line]
    return [e for e in events if e.get("event") == "vllm_decode_started" and e.get("request_id") == rid]
