"""All vLLM: ``mmpipe up --mode e-pd|e-p-d --engine vllm --vllm-encoder``.
The encode worker runs vLLM encoder-only (``ec_producer`` of
ECExampleConnector) and writes each image's encoder output into the
deployment's folder; only the items' vLLM hashes and grids ride in mmpipe's
message; the vLLM prefill+decode worker, or apart the vLLM prefill worker and
the vLLM decode worker (all ``ec_consumer``s; decode computes the prompt's
tail after the KV blocks it got, images there included), load them by hash.
The openai client gets exactly transformers ``generate()``'s tokens. (The
mixed case, mmpipe's encode worker feeding a vLLM prefill+decode worker, is
test_vllm_engine.py's e-pd stack.) The workers that write the connectors'
folders prune them by age (``--vllm-storage-ttl``).

Last, the engine-core process of the last worker's vLLM is killed: that
worker's readiness fails (``engine_dead``) and the worker stops rather than
take requests it can only fail.

One engine start per vLLM worker and mode."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from schemas.routes import MODES
from tests.e2e.conftest import make_reference
from tests.e2e.engine_crash import probe, readiness_until_gone
from tests.vllm.references import video_content
from tests.vllm.test_vllm_engine import (
    ENGINE_ARGS,
    MODEL,
    N,
    VllmStack,
    _ask,
    _image,
    _image_content,
    assert_images_and_concurrent_requests,
    vllm_up,
)

# --vllm-storage-ttl of the stacks: longer than a hop takes (each use of a
# file renews it), short enough to see the folders pruned at the end.
TTL_S = 15.0


@pytest.fixture(scope="module")
def reference(vllm_model_dir: Path) -> Any:
    return make_reference(vllm_model_dir)


# Both modes vLLM encoder-only serves: e-pd (a vLLM prefill+decode reads the
# encoder cache) and e-p-d (a vLLM prefill and a vLLM decode both read it).
MODES_UNDER_TEST = ["e-pd", "e-p-d"]


@pytest.fixture(scope="module", params=MODES_UNDER_TEST)
def all_vllm(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, mmpipe_home: Path, vllm_model_dir: Path
) -> Iterator[tuple[VllmStack, Path, dict[str, bool]]]:
    mode = request.param
    tmp = tmp_path_factory.mktemp(f"vllm-encoder-{mode}")
    # vLLM encoder-only profiles its encoder with a dummy item of each kind
    # allowed, and this CPU venv has no video processor: images only (the
    # vLLM encoder takes images only anyway).
    args = {**ENGINE_ARGS, "limit_mm_per_prompt": {"image": {"count": 4, "width": 224, "height": 224}, "video": 0}}
    ec_path = tmp / "ec"
    flags = ["--vllm-encoder", "--vllm-ec-path", str(ec_path), "--vllm-storage-ttl", str(TTL_S)]
    state = {"engine_killed": False}
    with vllm_up(tmp, mmpipe_home, mode, vllm_model_dir, args, *flags) as stack:
        yield stack, ec_path, state
    # The last test kills an engine core: mmpipe up then stops with 1, as it
    # does whenever one of its workers exits.
    assert stack.code == (1 if state["engine_killed"] else 0), stack.up.text()[-3000:]


def _events(stack: VllmStack, name: str) -> list[dict[str, Any]]:
    lines = [line for line in stack.up.text().splitlines() if f'"{name}"' in line]
    return [json.loads(line[line.index("{") :]) for line in lines]


@pytest.mark.e2e
async def test_image_through_vllm_encoder_equals_generate(all_vllm: Any, reference: Any) -> None:
    stack, ec_path, _ = all_vllm
    one = _image(1)
    tokens, text = reference(_image_content(one), [one], N)
    assert await _ask(stack, _image_content(one), stream=True) == (text, tokens)
    assert await _ask(stack, _image_content(one), stream=False) == (text, tokens)
    # vLLM encoder-only encoded it: its hash names a file in the deployment's folder.
    hashes = {h for event in _events(stack, "vllm_encoded") for h in event["mm_hashes"]}
    assert hashes and all((ec_path / h / "encoder_cache.safetensors").is_file() for h in hashes)


@pytest.mark.e2e
async def test_two_images_and_concurrent_requests(all_vllm: Any, reference: Any) -> None:
    one, two = _image(2), _image(3)
    captioned = [("Compare", one), ("and", two), ("and again", one)]  # one image twice
    await assert_images_and_concurrent_requests(all_vllm[0], reference, captioned)


def _image_tokens_past_the_kv_blocks(model_dir: Path, content: list[dict[str, Any]], image_tokens: int) -> bool:
    """Whether the image's tokens reach past the last full 32-token block of
    the prompt less its last token: what ExampleConnector hands decode."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    parts = [{"type": "image"} if p["type"] == "image_url" else p for p in content]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    start = ids.index(tokenizer.convert_tokens_to_ids("<|image_pad|>"))
    length = len(ids) - 1 + image_tokens
    return start + image_tokens > (length - 1) // 32 * 32


@pytest.mark.e2e
async def test_text_before_the_image_equals_generate(all_vllm: Any, reference: Any, vllm_model_dir: Path) -> None:
    """The image's tokens straddle the last KV block: a decode worker
    computes some of them itself, from the encoder cache too."""
    stack = all_vllm[0]
    image = _image(2)  # 9 tokens (a 72 x 80 image becomes 84 x 84: 6 x 6 patches, merged 2 x 2)
    content = [
        {"type": "text", "text": "Here is a picture taken last summer near the old harbour:"},
        *_image_content(image, "Describe it."),
    ]
    assert _image_tokens_past_the_kv_blocks(vllm_model_dir, content, 9)
    tokens, text = reference(content, [image], N)
    assert await _ask(stack, content, stream=True) == (text, tokens)


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


def _pruned(url: str) -> dict[str, float]:
    """mmpipe_vllm_storage_pruned_total by folder on a worker's /metrics."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        sample.labels["folder"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "mmpipe_vllm_storage_pruned_total"
    }


@pytest.mark.e2e
async def test_the_writers_prune_their_folders(all_vllm: Any) -> None:
    """The encode worker prunes the encoder-cache folder; apart, the prefill
    worker the KV folder (ExampleConnector); both count it on /metrics."""
    stack, ec_path, _ = all_vllm
    folders = {"encode": ("ec", ec_path)}
    if stack.mode == "e-p-d":  # mmpipe up's KV folder: <data-dir>/vllm-kv
        folders["prefill"] = ("kv", ec_path.parent / "data" / "vllm-kv")

    def left() -> list[Path]:
        return [entry for _, path in folders.values() for entry in path.iterdir()]

    assert all(any(path.iterdir()) for _, path in folders.values()), folders  # the module's requests wrote them
    for _ in range(int(3 * TTL_S / 0.5)):
        if not left():
            break
        await asyncio.sleep(0.5)
    assert not left(), folders
    for role, (name, _) in folders.items():
        assert (await asyncio.to_thread(_pruned, stack.metrics[role])).get(name, 0) > 0, role


@pytest.mark.e2e
async def test_engine_core_killed_fails_readiness_and_stops_the_worker(all_vllm: Any) -> None:
    """Runs last (it ends the stack)."""
    stack, _, state = all_vllm
    role = MODES[stack.mode][-1]
    url = stack.metrics[role].replace("/metrics", "/health/ready")
    assert (await asyncio.to_thread(probe, url))[0] == 200
    up = psutil.Process(stack.up.popen.pid)
    worker = next(p for p in up.children() if role in p.cmdline())
    cores = [p for p in worker.children(recursive=True) if "EngineCore" in p.name() + " ".join(p.cmdline())]
    assert cores, [(p.name(), p.cmdline()) for p in worker.children(recursive=True)]
    state["engine_killed"] = True
    for core in cores:
        core.kill()
    seen = await readiness_until_gone(worker, url)
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
