"""Cache-aware routing (``--router kv``) with real workers: each later turn
of a conversation goes to the worker whose prefix cache holds its earlier
turns (every worker relays its KV events on NATS, the router indexes
them), tokens stay exactly generate()'s, and a hop sent to one worker
that does not take it goes back to the shared queue."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from pipeline.config import PipelineConfig, RouterSettings
from pipeline.connection import connect
from pipeline.replies import CHUNK_DECODER
from pipeline.router.router import DECISIONS
from pipeline.streams import ensure_streams
from pipeline.subjects import Subjects
from schemas.chunk import TokenChunk
from schemas.codec import encode
from schemas.request import ChatMessage, GenerateRequest, ImagePart, ImageURL, SamplingParams, TextPart
from stages.models import ModelSpec
from tests.e2e.conftest import client, gradient, png_data_url, start_stack
from tests.e2e.processes import Processes
from tests.polling import eventually, eventually_true

N = 4
CONVERSATIONS = 6


def _conversation(seed: int) -> list[dict[str, Any]]:
    image = gradient(64, 48, seed)
    history = f"Conversation {seed}: we talked about the sea and the mountains for a long while. " * 4
    return [
        {"type": "text", "text": history},
        {"type": "image_url", "image_url": {"url": png_data_url(image)}},
        {"type": "text", "text": "What is in the picture?"},
    ]


async def _turn(c: Any, messages: list[dict[str, Any]]) -> tuple[str, int, int]:
    r = await c.chat.completions.create(
        model="tiny-qwen2-vl", messages=messages, max_tokens=N, temperature=0, extra_body={"min_tokens": N}
    )
    usage = r.usage
    return r.choices[0].message.content or "", usage.prompt_tokens, int(usage.prompt_tokens_details.cached_tokens)


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["epd", "e-pd"])
async def test_each_later_turn_goes_to_the_worker_that_holds_its_prefix(
    pipeline_config: PipelineConfig, model_spec: ModelSpec, mode: str
) -> None:
    """Two workers that prefill; the router is the bridge (epd) or the
    encode worker (e-pd), which knows the media's token counts exactly. In
    e-pd two encode workers too: the bridge sends a turn's media to the
    one that holds their embeddings."""
    config = dataclasses.replace(pipeline_config, mode=mode, router=RouterSettings(mode="kv"))
    prefill_role = "encode+prefill+decode" if mode == "epd" else "prefill+decode"
    counts = {prefill_role: 2} if mode == "epd" else {"encode": 2, prefill_role: 2}
    stack, stop = await start_stack(config, model_spec, counts=counts, bridge_processes=True)
    try:
        holders = [w for w in stack.workers if w.role == prefill_role]
        router = stack.bridge.router if mode == "epd" else next(w for w in stack.workers if w.role == "encode").router
        await eventually(lambda: all(router.alive(w.worker_id) for w in holders), within=10)

        def placed(role: str = prefill_role) -> float:
            return DECISIONS.labels(role, "worker")._value.get()

        before, encodes_before = placed(), placed("encode")
        skipped_before = DECISIONS.labels("encode", "skipped")._value.get()
        async with client(stack) as c:
            firsts = []
            for seed in range(CONVERSATIONS):
                messages = [{"role": "user", "content": _conversation(seed)}]
                text, prompt, cached = await _turn(c, messages)
                # At most the chat template's system prompt, shared by every conversation.
                assert cached <= 16
                firsts.append((messages, text, prompt))
            # Each worker relayed what it cached: the router knows where each conversation is.
            await eventually(
                lambda: sum(router.index.blocks_of(w.worker_id) for w in holders) >= CONVERSATIONS * 4, within=10
            )
            for messages, text, prompt in firsts:
                messages += [
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": "And what else do you see?"},
                ]
                _, prompt2, cached = await _turn(c, messages)
                # The whole first prompt but its last block (or less) came from the cache.
                assert cached >= prompt - 16 - 1, (cached, prompt, prompt2)
        # Placed by the router, each of them: not a shared queue's luck.
        assert placed() - before >= CONVERSATIONS
        if mode == "e-pd":
            # Each later turn skipped the encode hop (its media's tokens
            # cached on a prefill worker) or went to the encode worker
            # holding its media's embeddings.
            skipped = DECISIONS.labels("encode", "skipped")._value.get() - skipped_before
            assert placed("encode") - encodes_before + skipped >= CONVERSATIONS
    finally:
        await stop()


@pytest.mark.e2e
async def test_in_e_pd_a_turn_whose_media_a_prefill_worker_caches_skips_the_encode_hop(
    pipeline_config: PipelineConfig, model_spec: ModelSpec, reference: Any
) -> None:
    """The bridge's router sends a repeated turn straight to the
    prefill+decode worker whose prefix cache holds its image's tokens: the
    encode worker never sees it, the answer is generate()'s. Where that
    worker does not know the media (it never prefilled them) or its blocks
    went since the router looked, it runs the request again from the
    encode hop: the same answer, once."""
    from pipeline.bench.multiturn import encode_hops_skipped
    from pipeline.bridge import processing
    from pipeline.metrics import RESTARTS

    config = dataclasses.replace(pipeline_config, mode="e-pd", router=RouterSettings(mode="kv"))
    role = "prefill+decode"
    stack, stop = await start_stack(config, model_spec, bridge_processes=True)
    try:
        [encoder] = [w for w in stack.workers if w.role == "encode"]
        [holder] = [w for w in stack.workers if w.role == role]
        router = stack.bridge.router
        await eventually(lambda: router.alive(holder.worker_id), within=10)
        # A whole block of text after the image: the last, partial block is never cached.
        question = {"type": "text", "text": "What is in the picture? Say what its colours and shapes are. " * 2}

        def conversation(seed: int) -> tuple[list[dict[str, Any]], list[int], str]:
            content = [*_conversation(seed)[:-1], question]
            parts = [{**p, "image_url": {"url": ""}} if p["type"] == "image_url" else p for p in content]
            return content, *reference(parts, [gradient(64, 48, seed)], N)

        def skipped() -> float:
            return DECISIONS.labels("encode", "skipped")._value.get()

        def restarts() -> float:
            return RESTARTS.labels(role)._value.get()

        async def skipped_by_hand(rid: str, content: list[dict[str, Any]]) -> list[int]:
            """The request as the router sends it past the encode hop, on the worker's own subject."""
            parts = [
                TextPart(p["text"]) if p["type"] == "text" else ImagePart(ImageURL(p["image_url"]["url"]))
                for p in content
            ]
            out = (await processing.process(stack.bridge.processor, _request(rid, parts), 0)).skipping_encode()
            sub = await stack.nc.subscribe(config.subjects.reply(rid))
            await stack.nc.jetstream().publish(
                config.subjects.routed(role, holder.worker_id), encode(out), headers={"Nats-Msg-Id": f"{rid}:0:1"}
            )
            return await _tokens(sub)

        content, expected, expected_text = conversation(5)
        messages = [{"role": "user", "content": content}]
        async with client(stack) as c:
            first, _, cached = await _turn(c, messages)
            assert first == expected_text and cached <= 16
            await eventually(lambda: router.index.blocks_of(holder.worker_id) >= 4, within=10)
            encoded, was_skipped = encoder.handled, skipped()
            again, prompt, cached = await _turn(c, messages)
            assert again == expected_text
            assert cached >= prompt - 16 - 1
            assert skipped() - was_skipped == 1 and encoder.handled == encoded
        # What `mmpipe bench --workload multiturn --router ...` reads of it, from the bridge's /metrics.
        assert await asyncio.to_thread(encode_hops_skipped, f"{stack.base_url}/v1") == skipped()

        # The blocks went after the router looked: the prefill finds them gone and runs it again from the encode hop.
        assert (await holder.stage.reset_prefix_cache() or 0) >= 4
        before, encoded = restarts(), encoder.handled
        assert await skipped_by_hand("blocks-gone", content) == expected
        assert restarts() - before == 1 and encoder.handled - encoded == 1

        # Media the worker never prefilled: it does not know them, and runs the request again from the encode hop.
        other, other_expected, _ = conversation(6)
        before, encoded = restarts(), encoder.handled
        assert await skipped_by_hand("unknown-media", other) == other_expected
        assert restarts() - before == 1 and encoder.handled - encoded == 1
    finally:
        await stop()


@pytest.mark.e2e
async def test_a_hop_sent_to_a_worker_killed_before_it_took_it_goes_back_to_the_shared_queue(
    pipeline_config: PipelineConfig, tmp_path: Path, mmpipe_home: Path, tiny_model_dir: Path, reference: Any
) -> None:
    """SIGKILL, as the chaos suite kills: the router sent a turn to the
    worker holding its prefix, which died before taking it; once the
    worker is silent the router's rescuer moves the hop back to the shared
    queue, and another worker answers with generate()'s tokens."""
    config = dataclasses.replace(pipeline_config, namespace="default", router=RouterSettings(mode="kv"))
    subjects = config.subjects
    role = "encode+prefill+decode"
    procs = Processes(tmp_path, mmpipe_home)
    nc, js = await connect(config.nats_url, "test-client")
    try:
        await ensure_streams(js, config)
        relayed: list[str] = []

        async def heard(msg: Any) -> None:
            relayed.append(msg.subject)

        await nc.subscribe(subjects.all_kv_events, cb=heard)
        processor = procs.worker("processor", config.nats_url, "epd", tiny_model_dir, "--router", "kv")
        holder = procs.worker(role, config.nats_url, "epd", tiny_model_dir, "--router", "kv")
        for proc in (processor, holder):
            await asyncio.to_thread(proc.wait_for, "worker_started")
        image = gradient(64, 48, 3)
        history = "We talked about the sea and the mountains for a long while. " * 4
        content = [TextPart(history), ImagePart(ImageURL(png_data_url(image))), TextPart("What is in the picture?")]
        first = await _generate(nc, js, subjects, "turn-1", content)
        # Its KV events reached NATS: the router knows the holder has the prompt.
        await eventually(lambda: bool(relayed), within=10)
        holder.kill()
        sub = await nc.subscribe(subjects.reply("turn-2"))
        await js.publish(subjects.requests, encode(_request("turn-2", content)))

        async def routed_to_the_dead() -> bool:
            info = await js.stream_info(subjects.stream(role), subjects_filter=subjects.all_routed(role))
            return sum((info.state.subjects or {}).values()) == 1

        await eventually_true(routed_to_the_dead, within=10, what="the turn waits on the killed worker's subject")
        procs.worker(role, config.nats_url, "epd", tiny_model_dir, "--router", "kv")
        second = await _tokens(sub)
        parts = [
            {"type": "text", "text": history},
            {"type": "image_url", "image_url": {"url": ""}},
            {"type": "text", "text": "What is in the picture?"},
        ]
        assert first == second == reference(parts, [image], N)[0]
        # Logged once the rescuer's round ends, which may be after the answer.
        await eventually(lambda: "routed_hops_rescued" in processor.text(), within=10)
    finally:
        await nc.close()
        await asyncio.to_thread(procs.stop_all)


def _request(rid: str, content: list[Any]) -> GenerateRequest:
    return GenerateRequest(
        rid,
        "tiny-qwen2-vl",
        [ChatMessage("user", content)],
        SamplingParams(max_tokens=N, min_tokens=N, temperature=0.0),
    )


async def _generate(nc: Any, js: Any, subjects: Subjects, rid: str, content: list[Any]) -> list[int]:
    sub = await nc.subscribe(subjects.reply(rid))
    await js.publish(subjects.requests, encode(_request(rid, content)))
    return await _tokens(sub)


async def _tokens(sub: Any) -> list[int]:
    tokens: list[int] = []
    while True:
        chunk = CHUNK_DECODER.decode((await sub.next_msg(timeout=120)).data)
        assert isinstance(chunk, TokenChunk), chunk
        tokens += chunk.token_ids
        if chunk.finish_reason is not None:
            return tokens


@pytest.mark.e2e
async def test_the_choices_of_a_prompt_follow_the_first_to_one_worker(
    pipeline_config: PipelineConfig, model_spec: ModelSpec
) -> None:
    """Two workers that prefill: the router sends every choice of an n=4
    request to the worker it sent the first to (its prompt cached nowhere
    yet), which prefills the prompt once and forks the other three. The
    choices are sampled to 32 tokens: a choice that comes after the first's
    hop has ended prefills on its own (docs/http-api.md), and on a busy
    machine the four come through the bridge's processes some way apart."""
    from stages.torch_engine.metrics import PREFILL_FORKS

    config = dataclasses.replace(pipeline_config, mode="epd", router=RouterSettings(mode="kv"))
    role = "encode+prefill+decode"
    stack, stop = await start_stack(config, model_spec, counts={role: 2}, bridge_processes=True)
    try:
        holders = [w for w in stack.workers if w.role == role]
        router = stack.bridge.router
        assert router is not None
        await eventually(lambda: all(router.alive(w.worker_id) for w in holders), within=10)
        async with client(stack) as c:
            for round_ in range(3):
                handled = [w.handled for w in holders]
                forks = PREFILL_FORKS._value.get()
                done = await c.completions.create(
                    model="tiny-qwen2-vl",
                    prompt=f"Round {round_}: the sea and the mountains are",
                    n=4,
                    seed=round_,
                    temperature=0.8,
                    max_tokens=32,
                    extra_body={"min_tokens": 32},
                )
                assert len({choice.text for choice in done.choices}) > 1
                took = sorted(w.handled - h for w, h in zip(holders, handled, strict=True))
                assert took == [0, 4], took
                assert PREFILL_FORKS._value.get() - forks == 3
    finally:
        await stop()
