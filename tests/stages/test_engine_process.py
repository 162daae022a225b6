"""The built-in engine in its own process (``--engine-process``): the hop
stage as a plain async function, the engine core a real spawned process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from prometheus_client import CollectorRegistry, Gauge, ProcessCollector, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.config import PipelineConfig
from pipeline.metrics import before_scrape, show_engine_core
from pipeline.serve import WorkerSettings, build_stage
from schemas.chunk import TokenChunk
from schemas.errors import ContextLengthExceeded, ErrorCode, InvalidMedia
from schemas.request import ChatMessage, GenerateRequest, ImagePart, ImageURL, SamplingParams, TextPart
from stages.contract import HopContext
from stages.hop import HopStage
from stages.models import resolve_model
from stages.models.traits import load_traits
from stages.processor import Processor
from stages.torch_engine.core_client import EngineCoreDied, ProcessHopEngine
from stages.torch_engine.core_wire import Encoded, Prefilled
from stages.torch_engine.reference import reference_generate
from tests.e2e.conftest import gradient, png_data_url
from tests.polling import eventually_true

EPD = "encode+prefill+decode"


@pytest.fixture
async def stage(tiny_model_dir: Path) -> AsyncIterator[HopStage]:
    settings = WorkerSettings(model=str(tiny_model_dir), device="cpu", engine_process=True)
    s = build_stage(EPD, PipelineConfig(), settings)
    assert isinstance(s, HopStage) and isinstance(s.engine, ProcessHopEngine)
    await s.start()
    yield s
    await s.close()


@pytest.fixture(scope="module")
def processor(tiny_model_dir: Path) -> Processor:
    return Processor(load_traits(resolve_model(str(tiny_model_dir), "tiny")))


def engine(stage: HopStage) -> ProcessHopEngine:
    assert isinstance(stage.engine, ProcessHopEngine)
    return stage.engine


def request(rid: str, n: int, image: str | None = None, text: str = "What is it?") -> GenerateRequest:
    content: list[Any] = [ImagePart(ImageURL(image))] if image is not None else []
    return GenerateRequest(
        rid,
        "tiny",
        [ChatMessage("user", [*content, TextPart(text)])],
        SamplingParams(max_tokens=n, min_tokens=n, temperature=0),
    )


async def run(stage: HopStage, processed: Any) -> list[TokenChunk]:
    return [c async for c in stage.run(processed, HopContext())]  # type: ignore[misc]


def tokens(chunks: list[TokenChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


async def core_metric(stage: HopStage, name: str, **labels: str) -> float:
    """A sample of the core's own exposition (0 where it has none)."""
    text = (await engine(stage).scrape()).decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


async def held(stage: HopStage) -> tuple[float, float, float]:
    """Sequences and media the core holds for the worker, and its KV pool's usage."""
    return (
        await core_metric(stage, "mmpipe_engine_core_held", what="sequences"),
        await core_metric(stage, "mmpipe_engine_core_held", what="media"),
        await core_metric(stage, "mmpipe_kv_cache_usage"),
    )


async def test_requests_decoded_together_in_the_core_each_get_generates_tokens(
    stage: HopStage, processor: Processor, tiny_model_dir: Path
) -> None:
    one, two = gradient(60, 44, 3), gradient(32, 48, 7)
    reqs = [
        (processor.process(request("a", 10, png_data_url(one))), [one], 10),
        (processor.process(request("b", 6, text="Say something.")), [], 6),
        (processor.process(request("c", 8, png_data_url(two), text="And this?")), [two], 8),
    ]
    outs = await asyncio.gather(*(run(stage, p) for p, _, _ in reqs))
    for (p, images, n), chunks in zip(reqs, outs, strict=True):
        assert tokens(chunks) == reference_generate(tiny_model_dir, p.prompt_token_ids, images, n)
        assert [c.seq for c in chunks] == [sum(len(c.token_ids) for c in chunks[:i]) for i in range(len(chunks))]
        assert chunks[-1].finish_reason is not None
    await eventually_true(lambda: _all_zero(stage), what="the core to hold nothing once every request is done")


async def _all_zero(stage: HopStage) -> bool:
    return await held(stage) == (0.0, 0.0, 0.0)


async def test_a_consumer_leaving_mid_stream_frees_its_sequence_in_the_core(
    stage: HopStage, processor: Processor, tiny_model_dir: Path
) -> None:
    processed = processor.process(request("r", 40, png_data_url(gradient(60, 44, 3))))
    got = 0
    async with contextlib.aclosing(stage.run(processed, HopContext())) as chunks:
        async for chunk in chunks:
            got += len(chunk.token_ids)
            if got >= 3:
                break
    await eventually_true(lambda: _all_zero(stage), what="the left sequence's blocks back in the core's pool")
    again = processor.process(request("r2", 5, text="Say something."))
    assert tokens(await run(stage, again)) == reference_generate(tiny_model_dir, again.prompt_token_ids, [], 5)


@pytest.mark.parametrize("image", [True, False], ids=["image", "text"])
async def test_logprobs_come_from_the_core_as_the_engine_in_the_worker_gives_them(
    stage: HopStage, processor: Processor, tiny_model_dir: Path, image: bool
) -> None:
    """Each token's logprob and its step's best (and a text prompt's own)
    cross the core's pipe beside the tokens: the same chunks as the engine
    in the worker's own process gives (float32 on the CPU: the same values)."""
    asked = request("lp", 6, png_data_url(gradient(60, 44, 3)) if image else None)
    sampling = msgspec.structs.replace(asked.sampling, logprobs=3, prompt_logprobs=None if image else 2)
    processed = processor.process(msgspec.structs.replace(asked, sampling=sampling))
    in_worker = build_stage(EPD, PipelineConfig(), WorkerSettings(model=str(tiny_model_dir), device="cpu"))
    assert isinstance(in_worker, HopStage)
    await in_worker.start()
    try:
        want = await run(in_worker, processed)
    finally:
        await in_worker.close()
    got = await run(stage, processed)
    assert [t.logprobs for t in got] == [t.logprobs for t in want]
    assert sum(len(t.logprobs or []) for t in got) == 6 and all(
        len(lp.top) == 3 for t in got for lp in t.logprobs or []
    )
    assert got[0].prompt_logprobs == want[0].prompt_logprobs
    assert (got[0].prompt_logprobs is None) is image


@pytest.mark.parametrize("after_s", [0.0, 0.005, 0.02, 0.08])
async def test_a_request_cancelled_at_any_point_leaves_nothing_held_in_the_core(
    stage: HopStage, processor: Processor, after_s: float
) -> None:
    # Long enough that every point lands before its end (a warm tiny model makes 20 tokens in ~80 ms).
    processed = processor.process(request("c", 300, png_data_url(gradient(60, 44, 3))))
    task = asyncio.ensure_future(run(stage, processed))
    await asyncio.sleep(after_s)
    assert task.cancel(), "the request ended before it could be cancelled"
    with pytest.raises(asyncio.CancelledError):
        await task
    await eventually_true(lambda: _all_zero(stage), what="what the cancelled request held freed in the core")


async def test_a_reply_whose_caller_is_cancelled_before_it_wakes_frees_what_it_holds(
    stage: HopStage, processor: Processor
) -> None:
    """The core's reply comes (an encode's media, a prefill's sequence) and
    its caller is cancelled before it wakes to take it: the worker has the
    core free them, which would otherwise stay held there for good."""
    core = engine(stage)
    processed = processor.process(request("o", 4, png_data_url(gradient(60, 44, 3))))
    caller: asyncio.Future[Any] | None = None
    real = core._on

    def on(msg: Any) -> None:
        real(msg)  # the caller's reply is set here; it wakes only later
        if isinstance(msg, Encoded | Prefilled) and caller is not None and not caller.done():
            caller.cancel()

    core._on = on  # type: ignore[method-assign]
    try:
        caller = asyncio.ensure_future(core.encode(processed, HopContext()))
        with pytest.raises(asyncio.CancelledError):
            await caller
        await eventually_true(lambda: _all_zero(stage), what="the media of an encode whose caller left")
        media = await core.encode(processed, HopContext())
        caller = asyncio.ensure_future(core.prefill(processed, media, HopContext()))
        with pytest.raises(asyncio.CancelledError):
            await caller
        await eventually_true(lambda: _all_zero(stage), what="the sequence of a prefill whose caller left")
    finally:
        core._on = real  # type: ignore[method-assign]


async def test_errors_from_the_core_keep_their_code_and_the_core_serves_on(
    stage: HopStage, processor: Processor, tiny_model_dir: Path
) -> None:
    bad = processor.process(request("bad", 4, "data:image/png;base64,AAAAAAAA"))
    with pytest.raises(InvalidMedia) as info:
        await run(stage, bad)
    assert info.value.code is ErrorCode.INVALID_MEDIA
    # Too long once its image is expanded: the context check runs in the
    # worker, after the core encoded it; the embeddings it made go.
    long = msgspec.structs.replace(
        processor.process(request("long", 4, png_data_url(gradient(60, 44, 3)))), max_tokens=10**7
    )
    with pytest.raises(ContextLengthExceeded):
        await run(stage, long)
    await eventually_true(lambda: _all_zero(stage), what="the embeddings no prefill took dropped")
    ok = processor.process(request("ok", 5, text="Say something."))
    assert tokens(await run(stage, ok)) == reference_generate(tiny_model_dir, ok.prompt_token_ids, [], 5)


async def test_the_core_dying_fails_its_streams_and_the_workers_health(stage: HopStage, processor: Processor) -> None:
    processed = processor.process(request("d", 400, text="Say a lot."))
    core = engine(stage)
    seen = 0
    with pytest.raises(EngineCoreDied):
        async for chunk in stage.run(processed, HopContext()):  # type: ignore[attr-defined]
            seen += len(chunk.token_ids)
            if seen == 1:
                assert core.pid is not None
                os.kill(core.pid, signal.SIGKILL)
    assert 0 < seen < 400
    with pytest.raises(RuntimeError, match="engine core is gone"):
        await stage.health()
    assert not stage.has_room()
    with pytest.raises(EngineCoreDied):
        await run(stage, processor.process(request("e", 3, text="Hello.")))


async def test_the_cores_metrics_show_on_the_workers_metrics(stage: HopStage, processor: Processor) -> None:
    await run(stage, processor.process(request("m", 4, png_data_url(gradient(60, 44, 3)))))
    # A worker's registry: its own families (this test process has the
    # engine's as well, from the in-process tests), here one the core has too.
    registry = CollectorRegistry(auto_describe=True)  # as the default registry
    ProcessCollector(registry=registry)
    Gauge("mmpipe_kv_cache_usage", "the worker's own", registry=registry).set(0.5)
    hide = show_engine_core(engine(stage).scrape, registry)
    try:
        await before_scrape()
        text = generate_latest(registry).decode()
    finally:
        hide()
    families = list(text_string_to_metric_families(text))
    names = [f.name for f in families]
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}
    # The core's engine calls, as they ran there.
    assert samples[("mmpipe_engine_call_seconds_count", (("call", "prefill_one"),))] >= 1
    # Its threads and CPU, beside the worker's own.
    assert any(name == "mmpipe_engine_core_thread_cpu_seconds_total" and v > 0 for (name, _), v in samples.items())
    assert samples[("mmpipe_engine_core_process_cpu_seconds_total", ())] > 0
    assert ("process_cpu_seconds_total", ()) in samples
    # A family the worker has itself is its own, not the core's.
    assert samples[("mmpipe_kv_cache_usage", ())] == 0.5
    # Gone once hidden.
    assert "mmpipe_engine_core_process_cpu_seconds" not in generate_latest(registry).decode()


def test_a_role_that_hands_tensors_on_is_refused(tiny_model_dir: Path) -> None:
    settings = WorkerSettings(model=str(tiny_model_dir), device="cpu", engine_process=True)
    with pytest.raises(SystemExit, match="hands tensors"):
        build_stage("encode", PipelineConfig(), settings)


def test_vllm_with_an_engine_process_is_refused(tiny_model_dir: Path) -> None:
    settings = WorkerSettings(model=str(tiny_model_dir), device="cpu", engine="vllm", engine_process=True)
    with pytest.raises(SystemExit, match="built-in engine"):
        build_stage(EPD, PipelineConfig(), settings)


async def test_the_core_reuses_a_cached_prefix_says_so_and_forgets_it_when_asked(
    stage: HopStage, processor: Processor
) -> None:
    text = "Tell me about the sea and the mountains and the long way between them. " * 6
    first = await run(stage, processor.process(request("p1", 4, text=text)))
    again = await run(stage, processor.process(request("p2", 4, text=text)))
    assert first[-1].usage is not None and first[-1].usage.cached_tokens == 0
    assert again[-1].usage is not None and again[-1].usage.cached_tokens >= 64
    assert tokens(again) == tokens(first)
    assert await stage.reset_prefix_cache() >= 4
    third = await run(stage, processor.process(request("p3", 4, text=text)))
    assert third[-1].usage is not None and third[-1].usage.cached_tokens == 0


async def test_the_cores_engine_loads_adapters_sleeps_wakes_and_answers_its_canary(
    stage: HopStage, processor: Processor, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The engine's operations beside serving reach the core's engine: an
    adapter loaded there serves a request naming it (PEFT's generate()
    tokens) and is listed; sleep frees the core's KV cache and waking serves
    generate()'s tokens again; the canary runs through the core."""
    pytest.importorskip("peft")
    from tests.stages.test_lora import _reference, make_adapter

    peft_model = make_adapter(tiny_model_dir, tmp_path / "adapter", seed=3)
    assert stage.load_lora is not None and stage.loras is not None and stage.held_bytes is not None
    assert stage.sleep is not None and stage.wake_up is not None and stage.canary is not None
    assert stage.held_bytes()["weights"] > 0  # told at start
    await stage.load_lora("adapter", str(tmp_path / "adapter"))
    assert stage.loras() == ["adapter"] and stage.models[1:] == ["adapter"]
    asked = processor.process(request("l1", 6, text="Say something."))
    adapted = await run(stage, msgspec.structs.replace(asked, lora="adapter"))
    assert tokens(adapted) == _reference(tiny_model_dir, peft_model, asked.prompt_token_ids, [], 6)
    base = reference_generate(tiny_model_dir, asked.prompt_token_ids, [], 6)
    assert tokens(adapted) != base
    assert stage.unload_lora is not None
    await stage.unload_lora("adapter")
    assert stage.loras() == []

    before = await stage.sleep(1)
    assert before["kv_cache"] > 0 and stage.held_bytes()["kv_cache"] == 0
    await stage.wake_up()
    assert stage.held_bytes()["kv_cache"] == before["kv_cache"]
    assert tokens(await run(stage, processor.process(request("l2", 6, text="Say something.")))) == base
    await stage.canary()
