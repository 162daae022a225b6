"""Prompt embeddings on ``--engine vllm`` (vLLM's enable_prompt_embeds):
``prompt_embeds`` in /v1/completions through the official client gives
``generate(inputs_embeds=...)``'s tokens, streamed and not; a worker whose
vLLM was not started for them, or a split prefill role (vLLM's KV
connectors key a prompt by its ids), answers a 400 that says why."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from transformers import AutoTokenizer

from stages.torch_engine.reference import load_reference_model, reference_generate_embeds
from tests.e2e.test_prompt_embeds import off_token_embeds
from tests.vllm.test_vllm_engine import MODEL, N, assert_clean_exit, vllm_up


def torch_saved(tensor: torch.Tensor) -> str:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


async def complete_embeds(c: openai.AsyncOpenAI, embeds: str, **kw: Any) -> Any:
    return await c.completions.create(
        model=MODEL, prompt="", max_tokens=N, temperature=0, extra_body={"prompt_embeds": embeds, "min_tokens": N}, **kw
    )


def _embeds(model_dir: Path) -> tuple[torch.Tensor, str]:
    """A prompt's embeddings moved off any token's, and generate()'s text for them."""
    model = load_reference_model(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    embeds = off_token_embeds(model, tokenizer)
    expected = reference_generate_embeds(model_dir, embeds, N, model=model)
    return embeds, tokenizer.decode(expected, skip_special_tokens=True)


@pytest.mark.e2e
async def test_prompt_embeds_on_vllm_give_generates_tokens(
    tmp_path: Path, mmpipe_home: Path, vllm_model_dir: Path
) -> None:
    embeds, expected = _embeds(vllm_model_dir)
    args = {"enable_prompt_embeds": True}
    with vllm_up(tmp_path, mmpipe_home, "epd", vllm_model_dir, args, modalities="image") as stack:
        async with stack.client() as c:
            done = await complete_embeds(c, torch_saved(embeds))
            assert done.choices[0].text == expected
            assert done.usage is not None and (done.usage.prompt_tokens, done.usage.completion_tokens) == (
                len(embeds),
                N,
            )
            streamed = "".join(
                [chunk.choices[0].text async for chunk in await complete_embeds(c, torch_saved(embeds), stream=True)]
            )
            assert streamed == expected
            with pytest.raises(openai.BadRequestError, match="hidden size"):
                await complete_embeds(c, torch_saved(torch.zeros(3, embeds.shape[1] + 1)))
            again = await complete_embeds(c, torch_saved(embeds))  # the worker serves on
            assert again.choices[0].text == expected
    assert_clean_exit(stack)
