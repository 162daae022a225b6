"""LoRA adapters at run time through vLLM's endpoints, on real workers and
the tiny model: loaded on every worker that runs the language model,
listed in /v1/models, a request naming one gets transformers + PEFT
generate()'s tokens (the base model's still its own), in EPD and in E/P/D
(the decode worker runs the adapter over the KV cache it is handed); a bad
adapter is a 400 that leaves nothing loaded; unloaded, it is a 404."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from transformers import AutoTokenizer

from pipeline.config import PipelineConfig
from stages.models import ModelSpec
from stages.torch_engine.reference import reference_generate
from stages.torch_engine.settings import DecodeSettings
from tests.e2e.conftest import N, client, start_stack
from tests.stages.test_lora import make_adapter

BASE = "tiny-qwen2-vl"
PROMPT = "The sea and the mountains are"


async def post_json(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, str]:
    async with session.post(url, json=body) as response:
        return response.status, await response.text()


async def complete_text(c: openai.AsyncOpenAI, model: str) -> str:
    done = await c.completions.create(
        model=model, prompt=PROMPT, max_tokens=N, temperature=0, extra_body={"min_tokens": N}
    )
    return done.choices[0].text


@pytest.mark.e2e
@pytest.mark.parametrize(("mode", "engine_process"), [("epd", False), ("e-p-d", False), ("epd", True)])
async def test_an_adapter_loaded_at_run_time_gives_peft_generates_tokens(
    pipeline_config: PipelineConfig, model_spec: ModelSpec, tmp_path: Path, mode: str, engine_process: bool
) -> None:
    """In each mode; in EPD with the engine in a core process of its own (--engine-process) too."""
    model_dir = model_spec.path
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tokenizer(PROMPT)["input_ids"]
    peft_model = make_adapter(model_dir, tmp_path / "adapter", seed=3)
    with_adapter = tokenizer.decode(
        reference_generate(model_dir, ids, [], N, model=peft_model.get_base_model()), skip_special_tokens=True
    )
    (tmp_path / "empty").mkdir()
    config = PipelineConfig(nats_url=pipeline_config.nats_url, namespace=pipeline_config.namespace, mode=mode)
    stack, stop = await start_stack(config, model_spec, engine_process=engine_process)
    session = aiohttp.ClientSession()
    try:
        async with client(stack) as c:
            base = await complete_text(c, BASE)
            assert base != with_adapter
            load = f"{stack.base_url}/v1/load_lora_adapter"
            status, text = await post_json(session, load, {"lora_name": "sea", "lora_path": str(tmp_path / "adapter")})
            assert (status, text) == (200, "Success: LoRA adapter 'sea' added successfully.")
            models = {m.id: m for m in (await c.models.list()).data}
            assert set(models) == {BASE, "sea"}
            assert models["sea"].model_extra == {"root": str(tmp_path / "adapter"), "parent": BASE}
            assert await complete_text(c, "sea") == with_adapter
            assert await complete_text(c, BASE) == base

            # A bad adapter: a 400 naming why, and no worker keeps it.
            status, text = await post_json(session, load, {"lora_name": "bad", "lora_path": str(tmp_path / "empty")})
            assert status == 400 and "adapter_config.json" in text
            status, text = await post_json(session, load, {"lora_name": "sea", "lora_path": str(tmp_path / "adapter")})
            assert status == 400 and "already been loaded" in text
            assert {m.id for m in (await c.models.list()).data} == {BASE, "sea"}
            with pytest.raises(openai.NotFoundError):
                await complete_text(c, "bad")

            unload = f"{stack.base_url}/v1/unload_lora_adapter"
            status, text = await post_json(session, unload, {"lora_name": "sea"})
            assert (status, text) == (200, "Success: LoRA adapter 'sea' removed successfully.")
            with pytest.raises(openai.NotFoundError):
                await complete_text(c, "sea")
            status, _ = await post_json(session, unload, {"lora_name": "sea"})
            assert status == 404
            assert await complete_text(c, BASE) == base
    finally:
        await session.close()
        await stop()


@pytest.mark.e2e
async def test_with_max_loras_a_load_past_the_room_is_a_400_and_the_loaded_one_serves_on(
    pipeline_config: PipelineConfig, model_spec: ModelSpec, tmp_path: Path
) -> None:
    """--max-loras 1 on the fused step (the stacks made at start, written in
    place at each load): a second adapter is a 400 naming the flag, the first
    still gives PEFT's text, and once it is unloaded the second loads into its
    room and gives its own."""
    model_dir = model_spec.path
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tokenizer(PROMPT)["input_ids"]
    texts = {}
    for name, seed in (("sea", 3), ("sky", 4)):
        peft_model = make_adapter(model_dir, tmp_path / name, seed=seed)
        made = reference_generate(model_dir, ids, [], N, model=peft_model.get_base_model())
        texts[name] = tokenizer.decode(made, skip_special_tokens=True)
    config = PipelineConfig(nats_url=pipeline_config.nats_url, namespace=pipeline_config.namespace, mode="epd")
    decode = DecodeSettings(fused=True, max_loras=1, max_lora_rank=8)
    stack, stop = await start_stack(config, model_spec, decode=decode)
    session = aiohttp.ClientSession()
    load, unload = f"{stack.base_url}/v1/load_lora_adapter", f"{stack.base_url}/v1/unload_lora_adapter"
    try:
        async with client(stack) as c:
            status, _ = await post_json(session, load, {"lora_name": "sea", "lora_path": str(tmp_path / "sea")})
            assert status == 200 and await complete_text(c, "sea") == texts["sea"]
            status, text = await post_json(session, load, {"lora_name": "sky", "lora_path": str(tmp_path / "sky")})
            assert status == 400 and "--max-loras 1" in text
            assert {m.id for m in (await c.models.list()).data} == {BASE, "sea"}
            assert await complete_text(c, "sea") == texts["sea"]
            status, _ = await post_json(session, unload, {"lora_name": "sea"})
            assert status == 200
            status, _ = await post_json(session, load, {"lora_name": "sky", "lora_path": str(tmp_path / "sky")})
            assert status == 200 and await complete_text(c, "sky") == texts["sky"]
    finally:
        await session.close()
        await stop()


@pytest.mark.e2e
async def test_workers_started_later_serve_the_adapters_already_loaded(
    pipeline_config: PipelineConfig, model_spec: ModelSpec, tmp_path: Path
) -> None:
    """Scaling out is starting more workers: a deployment's workers and
    bridge started after an adapter was loaded find it in the adapters
    bucket, load it at start and serve it, with no new load call."""
    model_dir = model_spec.path
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    peft_model = make_adapter(model_dir, tmp_path / "adapter", seed=5)
    expected = tokenizer.decode(
        reference_generate(model_dir, tokenizer(PROMPT)["input_ids"], [], N, model=peft_model.get_base_model()),
        skip_special_tokens=True,
    )
    first, stop = await start_stack(pipeline_config, model_spec)
    try:
        async with aiohttp.ClientSession() as session:
            body = {"lora_name": "sky", "lora_path": str(tmp_path / "adapter")}
            status, _ = await post_json(session, f"{first.base_url}/v1/load_lora_adapter", body)
            assert status == 200
    finally:
        await stop()
    later, stop = await start_stack(pipeline_config, model_spec)
    try:
        async with client(later) as c:
            assert "sky" in {m.id for m in (await c.models.list()).data}
            assert await complete_text(c, "sky") == expected
    finally:
        await stop()
