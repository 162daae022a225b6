"""Disaggregated modes through the official openai client: encode, prefill and
decode as separate workers with their own transports, over a real
nats-server and real NIXL (or the NATS object store). Each mode must give
exactly the tokens of transformers ``generate()`` in one process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from pipeline import metrics
from pipeline.config import PipelineConfig
from pipeline.connection import connect
from pipeline.replies import CHUNK_DECODER
from pipeline.transport.nixl import agent_bucket
from schemas.codec import encode
from schemas.processed import KvHandoff, ProcessedRequest
from schemas.request import ChatMessage, GenerateRequest, ImagePart, ImageURL, SamplingParams, TextPart
from schemas.routes import MODES
from schemas.tensors import TensorRef, TensorSpec
from stages.models import ModelSpec
from stages.models.traits import load_traits
from stages.processor import Processor
from tests.e2e.conftest import N, Stack, ask, client, gradient, image_content, png_data_url, start_stack

SPLIT_MODES = ("e-pd", "e-p-d", "ep-d")


def moded(config: PipelineConfig, mode: str) -> PipelineConfig:
    return PipelineConfig(nats_url=config.nats_url, namespace=config.namespace, mode=mode)


@pytest.fixture
async def make_stack(pipeline_config: PipelineConfig, model_spec: ModelSpec) -> AsyncIterator[Any]:
    stops: list[Any] = []

    async def make(mode: str, transport: str = "nixl", **kw: Any) -> Stack:
        stack, stop = await start_stack(moded(pipeline_config, mode), model_spec, transport=transport, **kw)
        stops.append(stop)
        return stack

    yield make
    for stop in stops:
        await stop()


def hop_bytes(mode: str) -> dict[tuple[str, str], float]:
    return {
        (role, direction): metrics.HOP_TENSOR_BYTES.labels(role, direction)._value.get()
        for role in MODES[mode]
        for direction in ("put", "get")
    }


@pytest.mark.e2e
@pytest.mark.parametrize("transport", ["nixl", "nats"])
@pytest.mark.parametrize("mode", SPLIT_MODES)
async def test_every_mode_equals_generate(make_stack: Any, reference: Any, mode: str, transport: str) -> None:
    stack = await make_stack(mode, transport)
    before = hop_bytes(mode)
    image = gradient(64, 48, 1)
    content = image_content(png_data_url(image))
    _, expected = reference(content, [image])
    _, expected_text = reference("Say something.", [])
    async with client(stack) as c:
        assert await ask(c, content, stream=True) == (expected, N)
        assert await ask(c, content, stream=False) == (expected, N)
        # Text only: the encode hop is skipped (or does nothing, in ep-d).
        assert await ask(c, "Say something.", stream=True) == (expected_text, N)
    # Each hop that moved tensors counted them, per role and direction.
    after = hop_bytes(mode)
    moved = {key: after[key] - before[key] for key in after}
    for role, direction in [(r, "put") for r in MODES[mode][:-1]] + [(r, "get") for r in MODES[mode][1:]]:
        assert moved[(role, direction)] > 0, (role, direction)
    assert moved[(MODES[mode][0], "get")] == moved[(MODES[mode][-1], "put")] == 0
    # Every tensor handed on was read and freed by its holder.
    for worker in stack.workers:
        if worker.tensors is not None:
            for _ in range(100):
                if worker.tensors.held_bytes == 0:
                    break
                await asyncio.sleep(0.02)
            assert worker.tensors.held_bytes == 0, worker.role


@pytest.mark.e2e
async def test_eight_concurrent_two_images_each_over_scaled_out_roles(
    make_stack: Any, reference: Any, image_server: str
) -> None:
    stack = await make_stack("e-p-d", counts={"encode": 2, "prefill": 2, "decode": 2})
    contents, expected = [], []
    for i in range(8):
        j = (i + 3) % 8
        images = [gradient(40 + 16 * i, 56 + 8 * i, i), gradient(40 + 16 * j, 56 + 8 * j, j)]
        content = [
            {"type": "text", "text": f"Compare picture {i}"},
            {"type": "image_url", "image_url": {"url": f"{image_server}/img{i}.png"}},
            {"type": "text", "text": "with"},
            {"type": "image_url", "image_url": {"url": f"{image_server}/img{j}.png"}},
        ]
        contents.append(content)
        expected.append((reference(content, images)[1], N))
    async with client(stack) as c:
        got = await asyncio.gather(*(ask(c, content, stream=i % 2 == 0) for i, content in enumerate(contents)))
    assert got == expected
    assert len(set(expected)) == 8
    # Both workers of each role took part.
    for role in ("encode", "prefill", "decode"):
        assert all(w.handled > 0 for w in stack.workers if w.role == role), role


@pytest.mark.e2e
async def test_sampled_tokens_are_the_same_in_every_mode(
    pipeline_config: PipelineConfig, model_spec: ModelSpec
) -> None:
    """Three sampled choices of an image prompt: the same three in every
    mode, each its own; the worker that prefills takes them together and
    prefills the prompt once (two forks). One mode's stack at a time: they
    share the nats-server's queues."""
    from stages.torch_engine.metrics import PREFILL_FORKS

    content = image_content(png_data_url(gradient(50, 70, 4)))
    outputs = []
    for mode in ("epd", *SPLIT_MODES):
        stack, stop = await start_stack(moded(pipeline_config, mode), model_spec)
        try:
            forks = PREFILL_FORKS._value.get()
            async with client(stack) as c:
                r = await c.chat.completions.create(
                    model="tiny-qwen2-vl",
                    messages=[{"role": "user", "content": content}],  # type: ignore[misc]
                    max_tokens=10,
                    temperature=0.9,
                    top_p=0.95,
                    seed=1234,
                    n=3,
                    extra_body={"min_tokens": 10},
                )
        finally:
            await stop()
        outputs.append([choice.message.content for choice in r.choices])
        assert PREFILL_FORKS._value.get() - forks == 2, mode
    assert all(out == outputs[0] for out in outputs), outputs
    assert len(set(outputs[0])) == 3 and all(outputs[0])


@pytest.mark.e2e
async def test_a_lost_kv_cache_restarts_the_request_from_its_first_hop(
    make_stack: Any, reference: Any, model_spec: ModelSpec, tiny_model_dir: Path
) -> None:
    stack = await make_stack("e-p-d")
    config = stack.config
    image = gradient(64, 48, 1)
    content = [ImagePart(ImageURL(png_data_url(image))), TextPart("Describe the picture.")]
    request = GenerateRequest(
        "lost-kv",
        "tiny-qwen2-vl",
        [ChatMessage("user", content)],
        SamplingParams(max_tokens=N, min_tokens=N, temperature=0.0),
    )
    processed = Processor(load_traits(model_spec), mode="e-p-d").process(request)
    # A decode message whose prefill worker is gone: nobody holds its KV.
    gone = TensorRef(
        transport="nixl",
        holder="prefill-vanished",
        key="k1",
        nbytes=64,
        tensors=[TensorSpec("float32", [16])],
        expires=time.time() + 60,
    )
    orphan = ProcessedRequest(
        **{f: getattr(processed, f) for f in ("request", "prompt_token_ids", "media", "route", "max_tokens", "seed")},
        hop_index=2,
        kv=KvHandoff(gone, prompt_len=100, output_ids=[5]),
    )
    nc, js = await connect(config.nats_url, "test-client")
    try:
        # It was an agent of this namespace (killed: its metadata stays in the
        # bucket); a holder that never was one is refused, not restarted.
        await (await js.key_value(agent_bucket(config.namespace))).put("prefill-vanished", b"metadata")
        sub = await nc.subscribe(config.subjects.reply("lost-kv"))
        await js.publish(config.subjects.work("decode"), encode(orphan))
        tokens: list[int] = []
        while True:
            chunk = CHUNK_DECODER.decode((await sub.next_msg(timeout=30)).data)
            tokens += chunk.token_ids  # type: ignore[union-attr]
            if chunk.finish_reason is not None:  # type: ignore[union-attr]
                break
    finally:
        await nc.close()
    expected, _ = reference(
        [{"type": "image_url", "image_url": {"url": ""}}, {"type": "text", "text": "Describe the picture."}], [image]
    )
    assert tokens == expected
    encode_worker = next(w for w in stack.workers if w.role == "encode")
    assert encode_worker.handled == 1  # the new attempt went through every hop again


@pytest.mark.e2e
async def test_a_full_tensor_budget_stops_fetching_until_a_reader_frees_it(make_stack: Any, reference: Any) -> None:
    # No prefill worker yet: whatever the encode worker puts stays held.
    stack = await make_stack("e-p-d", counts={"encode": 0, "prefill": 0})
    image = gradient(56, 56, 2)  # a 4x4 patch grid: 4 tokens x 64 floats = 1 KiB of embeddings
    encoder = await stack.add_worker("encode", budget_bytes=1024)
    content = image_content(png_data_url(image))
    _, expected = reference(content, [image])
    async with client(stack) as c:
        answers = [asyncio.create_task(ask(c, content, stream=True))]
        for _ in range(200):
            if encoder.tensors.held_bytes == 1024:
                break
            await asyncio.sleep(0.02)
        # Budget full: at most the one fetch already waiting when it filled
        # lands, and that request waits in put for room; the rest stay queued.
        answers += [asyncio.create_task(ask(c, content, stream=True)) for _ in range(3)]
        await asyncio.sleep(1.0)
        assert encoder.tensors.held_bytes == 1024 and encoder.handled <= 2
        subjects = stack.config.subjects
        consumer = await stack.nc.jetstream().consumer_info(subjects.stream("encode"), subjects.durable("encode"))
        assert consumer.num_pending == 4 - encoder.handled  # never delivered: still in the queue
        await asyncio.sleep(0.5)
        assert encoder.handled <= 2
        await stack.add_worker("prefill")
        assert await asyncio.gather(*answers) == [(expected, N)] * 4
    assert encoder.handled == 4


@pytest.mark.e2e
async def test_the_embedding_cache_lives_with_the_encode_role(make_stack: Any, reference: Any) -> None:
    stack = await make_stack("e-p-d")
    image = gradient(64, 48, 1)
    content = image_content(png_data_url(image))
    _, expected = reference(content, [image])
    async with client(stack) as c:
        assert await ask(c, content, stream=True) == (expected, N)
        assert await ask(c, content, stream=False) == (expected, N)
    [encoder] = [w for w in stack.workers if w.role == "encode"]
    cache = encoder.stage.engine.encoder.cache  # type: ignore[attr-defined]
    assert (cache.stats()["hits"], cache.stats()["misses"]) == (1, 1)
    # Prefill and decode workers encode nothing, so they keep no cache.
    assert all(w.stage.engine.encoder is None for w in stack.workers if w.role in ("prefill", "decode"))  # type: ignore[attr-defined]


@pytest.mark.e2e
@pytest.mark.parametrize("transport", ["nixl", "nats"])
async def test_a_client_that_goes_away_frees_the_tensors_held_for_it(make_stack: Any, transport: str) -> None:
    # No decode worker: the KV cache waits with the prefill worker for a reader.
    stack = await make_stack("e-p-d", transport, counts={"decode": 0})
    [prefill] = [w for w in stack.workers if w.role == "prefill"]
    async with client(stack) as c:
        waiting = asyncio.create_task(ask(c, image_content(png_data_url(gradient(64, 48, 1))), stream=True))
        for _ in range(300):
            if prefill.tensors.held_bytes > 0:
                break
            await asyncio.sleep(0.02)
        assert prefill.tensors.held_bytes > 0
        waiting.cancel()  # the client disconnects; the bridge publishes the cancel
        with pytest.raises(asyncio.CancelledError):
            await waiting
    for _ in range(100):  # the TTL is 60 s: only the cancel frees it this soon
        if prefill.tensors.held_bytes == 0:
            break
        await asyncio.sleep(0.02)
    assert prefill.tensors.held_bytes == 0
