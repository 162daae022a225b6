"""All vLLM: ``mmpipe up --mode e-pd --engine vllm --vllm-encoder``. The
encode worker runs vLLM encoder-only (``ec_producer`` of ECExampleConnector)
and writes each image's encoder output into the deployment's folder; only
the items' vLLM hashes and grids ride in mmpipe's message; the vLLM
prefill+decode worker (``ec_consumer``) loads them by hash. The openai
client gets exactly transformers ``generate()``'s tokens. (The mixed case,
mmpipe's encode worker feeding a vLLM prefill+decode worker, is
test_vllm_engine.py's e-pd stack.)

Last, the engine-core process of the prefill+decode worker's vLLM is
killed: that worker's readiness fails (``engine_dead``) and the worker stops
rather than take requests it can only fail.

One engine start per vLLM worker for the module."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest

from tests.e2e.conftest import make_reference, png_data_url
from tests.e2e.processes import Processes
from tests.vllm.references import video_content
from tests.vllm.test_vllm_engine import (
    ENGINE_ARGS,
    MODEL,
    N,
    VllmStack,
    _ask,
    _free_port,
    _free_port_run,
    _image,
    _image_content,
)


@pytest.fixture(scope="module")
def reference(vllm_model_dir: Path) -> Any:
    return make_reference(vllm_model_dir)


@pytest.fixture(scope="module")
def all_vllm(
    tmp_path_factory: pytest.TempPathFactory, mmpipe_home: Path, vllm_model_dir: Path
) -> Iterator[tuple[VllmStack, Path, dict[str, str], dict[str, bool]]]:
    tmp = tmp_path_factory.mktemp("vllm-encoder")
    args_file = tmp / "engine-args.json"
    # vLLM encoder-only profiles its encoder with a dummy item of each kind
    # allowed, and this CPU venv has no video processor: images only (the
    # vLLM encoder takes images only anyway).
    args_file.write_text(
        json.dumps(
            {**ENGINE_ARGS, "limit_mm_per_prompt": {"image": {"count": 4, "width": 224, "height": 224}, "video": 0}}
        )
    )
    port = _free_port()
    ec_path = tmp / "ec"
    procs = Processes(tmp, mmpipe_home)
    up = procs.start(
        "up", "--mode", "e-pd", "--engine", "vllm", "--vllm-encoder", "--vllm-ec-path", str(ec_path),
        "--vllm-args-file", str(args_file), "--vllm-arg", "max_model_len=2048", "--model", str(vllm_model_dir),
        "--served-model-name", MODEL, "--port", str(port), "--data-dir", str(tmp / "data"), "--transport", "nats",
        "--log-level", "INFO", "--worker-health-port", str(_free_port_run(4)), "--modalities", "image,video",
    )  # fmt: skip
    state = {"engine_killed": False}
    try:
        up.wait_for("mmpipe ready", timeout_s=300)
        nats_url = re.search(r"nats=(\S+)", up.text())
        assert nats_url is not None
        ready: dict[str, str] = {}
        for line in up.text().splitlines():
            if '"worker_health_port"' in line:
                event = json.loads(line[line.index("{") :])
                ready[event["role"]] = event["url"]
        yield VllmStack("e-pd", f"http://127.0.0.1:{port}", nats_url.group(1), up, metrics={}), ec_path, ready, state
    finally:
        code = up.stop(signal.SIGINT, timeout_s=90)
        procs.stop_all()
    # The last test kills an engine core: mmpipe up then stops with 1, as it
    # does whenever one of its workers exits.
    assert code == (1 if state["engine_killed"] else 0), up.text()[-3000:]


def _events(stack: VllmStack, name: str) -> list[dict[str, Any]]:
    lines = [line for line in stack.up.text().splitlines() if f'"{name}"' in line]
    return [json.loads(line[line.index("{") :]) for line in lines]


@pytest.mark.e2e
async def test_image_through_vllm_encoder_equals_generate(all_vllm: Any, reference: Any) -> None:
    stack, ec_path, _, _ = all_vllm
    one = _image(1)
    tokens, text = reference(_image_content(one), [one], N)
    assert await _ask(stack, _image_content(one), stream=True) == (text, tokens)
    assert await _ask(stack, _image_content(one), stream=False) == (text, tokens)
    # vLLM encoder-only encoded it: its hash names a file in the deployment's folder.
    hashes = {h for event in _events(stack, "vllm_encoded") for h in event["mm_hashes"]}
    assert hashes and all((ec_path / h / "encoder_cache.safetensors").is_file() for h in hashes)


@pytest.mark.e2e
async def test_two_images_and_concurrent_requests(all_vllm: Any, reference: Any) -> None:
    stack = all_vllm[0]
    one, two = _image(2), _image(3)
    pair = [
        {"type": "text", "text": "Compare"},
        {"type": "image_url", "image_url": {"url": png_data_url(one)}},
        {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": png_data_url(two)}},
        {"type": "text", "text": "and again"},
        {"type": "image_url", "image_url": {"url": png_data_url(one)}},
    ]
    contents = [pair, _image_content(two, "And this?"), "Tell me a joke."]
    media: list[list[Any]] = [[one, two, one], [two], []]
    expected = [reference(c, m, N) for c, m in zip(contents, media, strict=True)]
    got = await asyncio.gather(*(_ask(stack, c, stream=i % 2 == 0) for i, c in enumerate(contents)))
    assert got == [(text, tokens) for tokens, text in expected]


@pytest.mark.e2e
async def test_video_is_refused_by_the_vllm_encoder(all_vllm: Any) -> None:
    """vLLM encoder-only takes images; a video is a clear 422, not a failure."""
    stack = all_vllm[0]
    async with stack.client() as c:
        with pytest.raises(openai.UnprocessableEntityError) as caught:
            await c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": video_content()}], max_tokens=2
            )
    body = caught.value.body if isinstance(caught.value.body, dict) else {}
    assert body.get("code") == "unsupported_media", body


def _probe(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.e2e
async def test_engine_core_killed_fails_readiness_and_stops_the_worker(all_vllm: Any) -> None:
    """Runs last (it ends the stack)."""
    stack, _, ready, state = all_vllm
    url = ready["prefill+decode"]
    assert (await asyncio.to_thread(_probe, url))[0] == 200
    up = psutil.Process(stack.up.popen.pid)
    worker = next(p for p in up.children() if "prefill+decode" in p.cmdline())
    cores = [p for p in worker.children(recursive=True) if "EngineCore" in p.name() + " ".join(p.cmdline())]
    assert cores, [(p.name(), p.cmdline()) for p in worker.children(recursive=True)]
    state["engine_killed"] = True
    for core in cores:
        core.kill()
    seen: list[tuple[int, str]] = []
    deadline = time.monotonic() + 60
    while worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        try:
            status, body = await asyncio.to_thread(_probe, url)
            seen.append((status, body.get("status", "")))
        except (urllib.error.URLError, ConnectionError):
            pass  # the worker has stopped listening
        await asyncio.sleep(0.05)
    # Not ready once vLLM has seen its engine core die (probes in the moment
    # before it has still pass): engine_dead, then draining once the worker
    # has closed its engine; then gone rather than left serving errors.
    dead = next(i for i, (status, _) in enumerate(seen) if status == 503)
    assert all(status == 503 for status, _ in seen[dead:]), seen
    assert seen[dead][1] == "engine_dead", seen
    assert {status for _, status in seen[dead:]} <= {"engine_dead", "draining"}, seen
    assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE
    assert _events(stack, "vllm_engine_dead")
    # mmpipe up stops the deployment when a worker exits.
    assert await asyncio.to_thread(stack.up.popen.wait, 60) == 1
    assert _events(stack, "process_exited")
