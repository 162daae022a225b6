"""The built-in engine driven through the ``HopEngine`` interface alone, as
``HopStage`` drives any engine: each step on its own role's engine, with a
real tensor store between them (the NATS object-store transport)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.connection import connect
from pipeline.nats_server import NatsServer
from pipeline.transport import TransportSettings, open_transport
from schemas.chunk import FinishReason, TokenChunk
from schemas.processed import ProcessedRequest
from schemas.request import ChatMessage, GenerateRequest, ImagePart, ImageURL, SamplingParams, TextPart
from stages.contract import HopContext, TensorStore
from stages.hop import HopStage
from stages.hop_engine import HopEngine, check_context
from stages.models import resolve_model
from stages.models.traits import load_traits
from stages.processor import Processor
from stages.torch_engine import metrics
from stages.torch_engine.engine import TorchEngine
from stages.torch_engine.hop_engine import TorchHopEngine
from stages.torch_engine.reference import reference_generate
from stages.torch_engine.settings import DecodeSettings
from tests.e2e.conftest import gradient, png_data_url
from tests.polling import eventually

N = 8


@pytest.fixture(params=["nats", "nixl"])
async def store(request: pytest.FixtureRequest, nats_server: NatsServer, namespace: str) -> AsyncIterator[TensorStore]:
    nc, js = await connect(nats_server.url, name="test-hop-engine")
    settings = TransportSettings(budget_bytes=64 << 20)
    transport = await open_transport(request.param, nc, js, namespace, settings, "hop")
    yield transport
    await transport.close()
    await nc.close()


@pytest.fixture
async def engines(tiny_model_dir: Path, store: TensorStore) -> AsyncIterator[dict[str, HopEngine[Any]]]:
    torch_engine = TorchEngine(tiny_model_dir)  # one model for the three roles: only the steps differ
    out: dict[str, HopEngine[Any]] = {
        role: TorchHopEngine(role, torch_engine, store) for role in ("encode", "prefill", "decode")
    }
    for engine in out.values():
        await engine.start()
    yield out
    for engine in out.values():
        await engine.close()


def image_request(rid: str, max_tokens: int = N, stop: list[str] | None = None) -> GenerateRequest:
    content = [ImagePart(ImageURL(png_data_url(gradient(60, 44, 3)))), TextPart("What is it?")]
    sampling = SamplingParams(max_tokens, 0.0, min_tokens=max_tokens, stop=stop or [])
    return GenerateRequest(rid, "tiny", [ChatMessage("user", content)], sampling)


async def e_p_d(
    engines: dict[str, HopEngine[Any]],
    req: ProcessedRequest,
    emitted: list[int],
    decode_emitted: list[int] | None = None,
) -> list[int]:
    """Encode, prefill and decode apart, each hop with its own context and
    only the message between them, as three workers would run them; the
    decode hop's client holds ``decode_emitted`` (default: ``emitted``)."""
    encode = engines["encode"]
    req = (await encode.send_media(await encode.encode(req, HopContext()), req, HopContext())).next_hop(req)
    assert req.encoded is not None and req.kv is None

    prefill, ctx = engines["prefill"], HopContext(emitted=list(emitted))
    media = await prefill.receive_media(req, ctx)
    check_context(req, media, prefill.max_model_len)
    handle = await prefill.prefill(req, media, ctx)
    try:
        req = (await prefill.hand_off(handle, req, ctx)).next_hop(req)
    finally:
        await prefill.abort(handle)
    assert req.encoded is None and req.kv is not None
    assert {"prefill_s", "get_s", "put_s", "put_bytes"} <= set(ctx.trace)

    decode, ctx = engines["decode"], HopContext(emitted=list(emitted if decode_emitted is None else decode_emitted))
    handle = await decode.receive_prefilled(req, ctx)
    assert handle.prompt_len > len(req.prompt_token_ids)  # the image's tokens, not its placeholder
    if decode_emitted is None:
        # The cache went straight into a slot of the batch decoder, ready to step.
        assert handle.seq.slot >= 0 and not handle.seq.receiving and {"get_s", "get_bytes"} <= set(ctx.trace)
    try:
        async with contextlib.aclosing(decode.decode(handle, req, ctx, decode.eos_token_ids.__contains__)) as tokens:
            return [t async for t in tokens]
    finally:
        await decode.abort(handle)


async def test_encode_prefill_and_decode_apart_equal_generate(
    engines: dict[str, HopEngine[Any]], tiny_model_dir: Path
) -> None:
    processor = Processor(load_traits(resolve_model(str(tiny_model_dir), "tiny")))
    req = processor.process(image_request("i1"))
    expected = reference_generate(tiny_model_dir, req.prompt_token_ids, [gradient(60, 44, 3)], N)
    assert await e_p_d(engines, req, []) == expected
    # A takeover: the client holds three tokens; the rest follow them.
    assert await e_p_d(engines, req, expected[:3]) == expected[3:]
    # A decode hop taken over mid-stream: its KV cache covers the prompt and
    # the prefill's token, the client holds four; they are fed, then the rest.
    assert await e_p_d(engines, req, [], decode_emitted=expected[:4]) == expected[4:]


async def test_health_fails_once_the_decode_loop_has_died(tiny_model_dir: Path) -> None:
    role = "encode+prefill+decode"
    engine: HopEngine[Any] = TorchHopEngine(role, TorchEngine(tiny_model_dir))
    processor = Processor(load_traits(resolve_model(str(tiny_model_dir), "tiny")))
    req = processor.process(
        GenerateRequest("h1", "tiny", [ChatMessage("user", "Hi")], SamplingParams(N, 0.0, ignore_eos=True))
    )
    await engine.start()
    try:
        await engine.health()

        asked: list[int] = []

        def broken(token: int) -> bool:
            # Asked first by the hop of prefill's token (whether the sequence
            # joins the batch at all), then by the loop, failing: the loop dies of it.
            asked.append(token)
            if len(asked) > 1:
                raise ZeroDivisionError
            return False

        ctx = HopContext()
        handle = await engine.prefill(req, [], ctx)
        tokens = engine.decode(handle, req, ctx, broken)
        got: list[int] = []
        # The stream fails instead of waiting for tokens that never come ...
        with pytest.raises(RuntimeError, match="decode loop has stopped"):
            async for token in tokens:
                got.append(token)
        assert len(got) == 2  # prefill's token, and the one the loop made before it died
        await engine.abort(handle)
        # ... and the worker is no longer ready.
        with pytest.raises(RuntimeError, match="decode loop has stopped"):
            await engine.health()
    finally:
        await engine.close()
    await engine.health()  # closed on purpose: nothing to report


@pytest.mark.parametrize("max_tokens", [1, N])
async def test_a_sequence_joins_the_batch_before_prefills_token_goes_out_unless_that_token_ends_it(
    tiny_model_dir: Path, max_tokens: int
) -> None:
    engine = TorchHopEngine("encode+prefill+decode", TorchEngine(tiny_model_dir))
    processor = Processor(load_traits(resolve_model(str(tiny_model_dir), "tiny")))
    req = processor.process(
        GenerateRequest("j1", "tiny", [ChatMessage("user", "Hi")], SamplingParams(max_tokens, 0.0, ignore_eos=True))
    )
    await engine.start()
    scheduler = engine.scheduler
    assert scheduler is not None
    try:
        ctx = HopContext()
        handle = await engine.prefill(req, [], ctx)
        tokens = engine.decode(handle, req, ctx, lambda _: False)
        first = await anext(tokens)
        assert first == handle.seq.output_ids[0]
        # While the caller still holds the first token, the loop has the sequence (or never gets it).
        assert scheduler.active == (1 if max_tokens > 1 else 0)
        rest = [token async for token in tokens]
        assert len(rest) == max_tokens - 1
        await engine.abort(handle)
        await eventually(lambda: scheduler.active == 0 and engine.torch.has_room(), within=5.0)
    finally:
        await engine.close()


async def split_stages(
    engines: dict[str, HopEngine[Any]], req: ProcessedRequest
) -> tuple[list[TokenChunk], ProcessedRequest | None, list[TokenChunk]]:
    """E/P/D through ``HopStage``: the prefill hop's chunks, its message to
    the decode hop (None when it finished the request), the decode hop's chunks."""
    stages = {role: HopStage(role, engine, "tiny") for role, engine in engines.items()}
    (req,) = [out async for out in stages["encode"].run(req, HopContext())]
    assert isinstance(req, ProcessedRequest)
    outs = [out async for out in stages["prefill"].run(req, HopContext())]
    first = [o for o in outs if isinstance(o, TokenChunk)]
    forwarded = [o for o in outs if isinstance(o, ProcessedRequest)]
    if not forwarded:
        return first, None, []
    (nxt,) = forwarded
    # The worker takes what the client holds from the message (no takeover here).
    rest = [out async for out in stages["decode"].run(nxt, HopContext(emitted=list(nxt.emitted)))]
    assert all(isinstance(c, TokenChunk) for c in rest)
    return first, nxt, rest  # type: ignore[return-value]


async def test_a_hop_ending_at_prefill_streams_its_token_before_the_hand_off(
    engines: dict[str, HopEngine[Any]], tiny_model_dir: Path
) -> None:
    processor = Processor(load_traits(resolve_model(str(tiny_model_dir), "tiny")))
    req = processor.process(image_request("f1"))
    expected = reference_generate(tiny_model_dir, req.prompt_token_ids, [gradient(60, 44, 3)], N)
    first, nxt, rest = await split_stages(engines, req)
    assert [(c.seq, c.token_ids, c.finish_reason) for c in first] == [(0, expected[:1], None)]
    assert nxt is not None and nxt.emitted == expected[:1] and nxt.kv is not None
    assert [c.seq for c in rest] == list(range(1, N))
    assert [t for c in rest for t in c.token_ids] == expected[1:]
    text = engines["decode"].tokenizer.decode(expected, skip_special_tokens=True)
    assert "".join(c.text for c in first + rest) == text

    # A request the first token ends never reaches the decode hop.
    one = processor.process(image_request("f2", max_tokens=1))
    first, nxt, rest = await split_stages(engines, one)
    assert nxt is None and rest == []
    assert [(c.seq, c.token_ids, c.finish_reason) for c in first] == [(0, expected[:1], FinishReason.LENGTH)]

    # A stop string across the two hops' tokens is found, its text never sent.
    stop = engines["decode"].tokenizer.decode(expected[:3], skip_special_tokens=True)[-2:]
    assert stop and stop in text
    stopped = processor.process(image_request("f3", stop=[stop]))
    first, nxt, rest = await split_stages(engines, stopped)
    chunks = first + rest
    assert chunks[-1].finish_reason == FinishReason.STOP
    assert "".join(c.text for c in chunks) == text[: text.index(stop)]


async def test_sequences_the_pool_cannot_hold_wait_or_are_swapped_out(tiny_model_dir: Path) -> None:
    """A KV pool with room for less than two whole requests: two join (a
    sequence joins with the blocks its cache fills), and as they grow the
    younger is swapped out and back, through the decode loop's launched steps; the
    rest wait for blocks (none steps on its own cache outside the pool),
    the engine says it has no room meanwhile, and every stream is
    generate()'s."""
    processor = Processor(load_traits(resolve_model(str(tiny_model_dir), "tiny")))
    reqs = [processor.process(image_request(f"w{i}")) for i in range(5)]
    expected = reference_generate(tiny_model_dir, reqs[0].prompt_token_ids, [gradient(60, 44, 3)], N)
    probe = TorchEngine(tiny_model_dir, decode=DecodeSettings(slots=8))
    assert probe.decoder is not None
    media = probe.encode([gradient(60, 44, 3)])
    need = probe.decoder.blocks_for(len(probe._prepare(reqs[0].prompt_token_ids, media, [])[0]) + N)
    memory = 2 * need * probe.decoder.bytes_per_block  # less than two budgets beside the null block
    max_len = (2 * need - 1) * probe.decoder.block_size  # what that pool can hold of one sequence
    decode = DecodeSettings(slots=8, max_len=max_len, kv_cache_memory=str(memory))
    torch_engine = TorchEngine(tiny_model_dir, decode=decode)
    alone: list[Any] = []
    step_one = torch_engine._step_one
    torch_engine._step_one = lambda seq: alone.append(seq) or step_one(seq)  # type: ignore[method-assign]
    engine = TorchHopEngine("encode+prefill+decode", torch_engine, max_batch=8)
    stage = HopStage(engine.role, engine, "tiny")
    preempted = metrics.PREEMPTIONS._value.get()
    await engine.start()
    rooms: list[bool] = []
    try:

        async def run(req: ProcessedRequest) -> list[int]:
            tokens = []
            async for out in stage.run(req, HopContext()):
                assert isinstance(out, TokenChunk)
                tokens += out.token_ids
                rooms.append(engine.has_room())
            return tokens

        got = await asyncio.gather(*(run(r) for r in reqs))
    finally:
        await engine.close()
    assert got == [expected] * len(reqs)
    assert not alone  # every sequence stepped in the batch decoder, after waiting
    assert metrics.PREEMPTIONS._value.get() > preempted
    assert False in rooms and rooms[-1]  # full while some waited; room again at the end
    assert torch_engine.decoder is not None
    assert torch_engine.decoder.pool.num_free == torch_engine.decoder.pool.capacity


def _calls(name: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("mmpipe_engine_call_seconds_count", {"call": name}) or 0.0


async def test_start_warms_the_media_decoders_the_tower_and_a_prefill(tiny_model_dir: Path) -> None:
    """Before a first request: the decode pool's processes are up and the
    engine thread has run an image through the tower and a prompt's prefill."""
    import multiprocessing

    from stages.media import MediaPolicy

    before_children = {p.pid for p in multiprocessing.active_children()}
    prefills, failures = _calls("prefill"), metrics.WARM_UP_FAILURES.labels("encode+prefill+decode")._value.get()
    engine = TorchHopEngine(
        "encode+prefill+decode", TorchEngine(tiny_model_dir), media_policy=MediaPolicy(decode_processes=2)
    )
    await engine.start()
    try:
        started = {p.pid for p in multiprocessing.active_children()} - before_children
        assert len(started) == 2
        # The engine thread counts a call after handing its result back: the count may trail the await.
        await eventually(lambda: _calls("prefill") > prefills)
        assert _calls("prefill") == prefills + 1
        assert metrics.WARM_UP_FAILURES.labels("encode+prefill+decode")._value.get() == failures
        # Warm, with nothing held: the pool's blocks all free again.
        assert engine.kv_usage()[0] == 0
    finally:
        await engine.close()


async def test_a_failed_warm_up_is_counted_and_the_engine_starts(tiny_model_dir: Path) -> None:
    role = "encode+prefill+decode"
    engine = TorchHopEngine(role, TorchEngine(tiny_model_dir))

    async def broken() -> None:
        raise RuntimeError("no")

    engine.canary = broken  # type: ignore[method-assign]
    failures = metrics.WARM_UP_FAILURES.labels(role)._value.get()
    await engine.start()
    try:
        assert metrics.WARM_UP_FAILURES.labels(role)._value.get() == failures + 1
        await engine.health()
    finally:
        await engine.close()
