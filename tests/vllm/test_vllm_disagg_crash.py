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
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import gradient, make_reference
from tests.e2e.engine_crash import events, killed_mid_stream, start_nats, stop_at_once
from tests.e2e.processes import Proc, Processes
from tests.vllm.test_vllm_engine import ENGINE_ARGS, MODEL, image_request

N = 300
MODE = "e-p-d"


@pytest.mark.e2e
@pytest.mark.timeout(600)  # five workers, three vLLM engines, started within the test
async def test_killed_vllm_decode_worker_request_completes_on_the_other(
    tmp_path: Path, mmpipe_home: Path, vllm_model_dir: Path
) -> None:
    procs = Processes(tmp_path, mmpipe_home)
    args_file = tmp_path / "engine-args.json"
    args_file.write_text(json.dumps(ENGINE_ARGS))
    try:
        nats_url = await start_nats(procs, str(tmp_path / "data"))
        common = ["--mode", MODE, "--nats-url", nats_url, "--model", str(vllm_model_dir)]
        # A short ack wait: the dead worker's message goes to the other one in
        # seconds (not so short that a live worker starved of the CPU for a
        # few seconds, on a busy 2-core machine, loses its message while it
        # runs it: its heartbeats come a third of the wait apart); a short
        # drain: nothing is in flight at the end.
        common += ["--served-model-name", MODEL, "--transport", "nats", "--ack-wait", "10", "--drain-grace", "2"]
        vllm = ["--engine", "vllm", "--vllm-args-file", str(args_file), "--vllm-arg", "max_model_len=2048"]
        vllm += ["--vllm-kv-connector", "example", "--vllm-kv-path", str(tmp_path / "kv")]
        workers = [procs.start("worker", role, *common) for role in ("processor", "encode")]
        workers.append(procs.start("worker", "prefill", *common, *vllm))
        decoders = [procs.start("worker", "decode", *common, *vllm) for _ in range(2)]
        for proc in [*workers, *decoders]:
            await asyncio.to_thread(proc.wait_for, "worker_started", 300)

        image = gradient(64, 48, 5)
        rid = "killed-vllm-decode"

        def started(proc: Proc) -> bool:
            return bool(events(proc, "vllm_decode_started", rid))

        held, chunks, first = await killed_mid_stream(nats_url, image_request(rid, image, N), decoders, started)
        other = decoders[1 - decoders.index(first)]
        assert len(held) < N  # killed mid-stream
        assert [c.seq for c in chunks] == list(range(N))  # each token once, in order
        content: list[dict[str, Any]] = [
            {"type": "image_url", "image_url": {"url": ""}},
            {"type": "text", "text": "What is in the picture?"},
        ]
        expected, _ = make_reference(vllm_model_dir)(content, [image], N)
        assert [t for c in chunks for t in c.token_ids] == expected
        # The other worker continued after the tokens the client held.
        resumed = [e["resumed"] for e in events(other, "vllm_decode_started", rid)]
        assert any(r >= len(held) for r in resumed), other.text()[-3000:]
    finally:
        await stop_at_once(procs)
