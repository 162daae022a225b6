"""LoRA adapters at run time on ``--engine vllm`` (vLLM's own LoRA, its CPU
punica kernels here): loaded through the bridge's /v1/load_lora_adapter
into every worker that runs the language model, listed in /v1/models, a
request naming one gets transformers + PEFT generate()'s tokens and the
base model keeps its own; unloaded, the adapter is a 404. (Without vLLM's
enable_lora a load is a 400 that says so: test_vllm_engine.py.)"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import openai
import pytest
from transformers import AutoTokenizer

from stages.torch_engine.reference import reference_generate
from tests.e2e.test_lora import PROMPT, complete_text, post_json
from tests.stages.test_lora import make_adapter
from tests.vllm.test_vllm_engine import MODEL, N, assert_clean_exit, vllm_up

LORA_ARGS = {"enable_lora": True, "max_lora_rank": 8}


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["epd", "e-pd"])
async def test_an_adapter_on_vllm_gives_peft_generates_tokens(
    tmp_path: Path, mmpipe_home: Path, vllm_model_dir: Path, mode: str
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(vllm_model_dir))
    ids = tokenizer(PROMPT)["input_ids"]
    peft_model = make_adapter(vllm_model_dir, tmp_path / "adapter", seed=3)
    adapted = reference_generate(vllm_model_dir, ids, [], N, min_new_tokens=N, model=peft_model.get_base_model())
    with_adapter = tokenizer.decode(adapted, skip_special_tokens=True)
    base = tokenizer.decode(reference_generate(vllm_model_dir, ids, [], N, min_new_tokens=N), skip_special_tokens=True)
    assert with_adapter != base
    (tmp_path / "empty").mkdir()
    with vllm_up(tmp_path, mmpipe_home, mode, vllm_model_dir, LORA_ARGS, modalities="image") as stack:
        async with aiohttp.ClientSession() as session, stack.client() as c:
            load = f"{stack.base_url}/v1/load_lora_adapter"
            status, text = await post_json(session, load, {"lora_name": "sea", "lora_path": str(tmp_path / "adapter")})
            assert (status, text) == (200, "Success: LoRA adapter 'sea' added successfully."), text
            assert {m.id for m in (await c.models.list()).data} == {MODEL, "sea"}
            assert await complete_text(c, "sea") == with_adapter
            assert await complete_text(c, MODEL) == base

            status, text = await post_json(session, load, {"lora_name": "bad", "lora_path": str(tmp_path / "empty")})
            assert status == 400 and "adapter_config.json" in text
            assert {m.id for m in (await c.models.list()).data} == {MODEL, "sea"}

            unload = f"{stack.base_url}/v1/unload_lora_adapter"
            status, text = await post_json(session, unload, {"lora_name": "sea"})
            assert status == 200, text
            with pytest.raises(openai.NotFoundError):
                await complete_text(c, "sea")
            assert await complete_text(c, MODEL) == base
    assert_clean_exit(stack)
