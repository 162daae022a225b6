"""The canary health check on a vLLM worker: while idle it pushes a tiny
request through vLLM's engine (a few tokens, one generated), the canaries
pass, the worker stays ready, and requests still give generate()'s tokens."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.conftest import make_reference
from tests.vllm.test_vllm_engine import ENGINE_ARGS, N, _ask, assert_clean_exit, vllm_up

ROLE = "encode+prefill+decode"


def _canaries(metrics_url: str) -> tuple[float, float]:
    """(canaries run, canaries failed) on a worker's /metrics."""
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    ran = failed = 0.0
    for line in text.splitlines():
        if line.startswith("mmpipe_canary_seconds_count") and f'role="{ROLE}"' in line:
            ran += float(line.split()[-1])
        if line.startswith("mmpipe_canary_failures_total") and f'role="{ROLE}"' in line:
            failed += float(line.split()[-1])
    return ran, failed


@pytest.mark.e2e
async def test_an_idle_vllm_worker_passes_its_canaries(tmp_path: Path, mmpipe_home: Path, vllm_model_dir: Path) -> None:
    tokens, text = make_reference(vllm_model_dir)("Say something.", [], N)
    with vllm_up(tmp_path, mmpipe_home, "epd", vllm_model_dir, ENGINE_ARGS, "--canary-interval", "0.3") as stack:
        metrics = stack.metrics[ROLE]
        deadline = time.monotonic() + 60
        while (await asyncio.to_thread(_canaries, metrics))[0] < 3:
            assert time.monotonic() < deadline, f"no canaries on {metrics}"
            await asyncio.sleep(0.2)
        assert (await asyncio.to_thread(_canaries, metrics))[1] == 0
        ready = await asyncio.to_thread(urllib.request.urlopen, metrics.replace("/metrics", "/health/ready"), timeout=5)
        assert ready.status == 200
        assert await _ask(stack, "Say something.", stream=True) == (text, tokens)
    assert_clean_exit(stack)
