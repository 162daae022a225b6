"""Prompt embeddings as input (``prompt_embeds`` in ``/v1/completions``, as
vLLM takes them) through the official openai client: a torch-saved or
safetensors tensor, base64, gives exactly ``generate(inputs_embeds=...)``'s
tokens in EPD and in E/P/D (the prefill worker's KV handed to the decode
worker); what does not fit the model is a 400 naming why."""

from __future__ import annotations

import base64
import io
from typing import Any

import openai
import pytest
import torch
from safetensors.torch import save as save_safetensors
from transformers import AutoTokenizer

from pipeline.config import PipelineConfig
from stages.models import ModelSpec
from stages.torch_engine.reference import load_reference_model, reference_generate_embeds
from tests.e2e.conftest import N, client, start_stack

MODEL = "tiny-qwen2-vl"


def _torch_saved(tensor: torch.Tensor) -> str:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def _safetensors(tensor: torch.Tensor) -> str:
    return base64.b64encode(save_safetensors({"embeds": tensor.contiguous()})).decode()


async def _complete(c: openai.AsyncOpenAI, embeds: str | list[str], **kw: Any) -> Any:
    return await c.completions.create(
        model=MODEL,
        prompt="",
        max_tokens=N,
        temperature=0,
        extra_body={"prompt_embeds": embeds, "min_tokens": N},
        **kw,
    )


def off_token_embeds(model: Any, tokenizer: Any, text: str = "The sea and the mountains are") -> torch.Tensor:
    """The model's own embeddings of ``text``, moved off any token's: no ids stand behind them."""
    ids = torch.tensor(tokenizer(text)["input_ids"])
    hidden = model.config.get_text_config().hidden_size
    with torch.inference_mode():
        noise = 0.05 * torch.randn(len(ids), hidden, generator=torch.Generator().manual_seed(1))
        return model.get_input_embeddings()(ids) + noise


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["epd", "e-p-d"])
async def test_prompt_embeds_give_generates_tokens(
    pipeline_config: PipelineConfig, model_spec: ModelSpec, mode: str
) -> None:
    model_dir = model_spec.path
    model = load_reference_model(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    embeds = off_token_embeds(model, tokenizer)
    tokens, hidden = embeds.shape
    halves = embeds.to(torch.bfloat16)
    expected = reference_generate_embeds(model_dir, embeds, N, model=model)
    expected_halves = reference_generate_embeds(model_dir, halves.float(), N, model=model)
    config = PipelineConfig(nats_url=pipeline_config.nats_url, namespace=pipeline_config.namespace, mode=mode)
    stack, stop = await start_stack(config, model_spec)
    try:
        async with client(stack) as c:
            done = await _complete(c, _torch_saved(embeds))
            assert done.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
            assert done.usage is not None and (done.usage.prompt_tokens, done.usage.completion_tokens) == (tokens, N)
            # A list of them, streamed; one in bfloat16 as safetensors, [1, tokens, hidden].
            pieces: dict[int, str] = {}
            async for chunk in await _complete(c, [_safetensors(halves[None]), _torch_saved(embeds)], stream=True):
                for choice in chunk.choices:
                    pieces[choice.index] = pieces.get(choice.index, "") + choice.text
            assert pieces == {
                0: tokenizer.decode(expected_halves, skip_special_tokens=True),
                1: tokenizer.decode(expected, skip_special_tokens=True),
            }
            bad = {
                "a wrong width": (_torch_saved(torch.zeros(3, hidden + 1)), f"hidden size is {hidden}"),
                "integers": (_torch_saved(torch.zeros(3, hidden, dtype=torch.int32)), "dtype"),
                "NaN": (_torch_saved(torch.full((3, hidden), float("nan"))), "NaN"),
                "no tensor": (base64.b64encode(b"not a tensor").decode(), "neither torch-saved nor a safetensors"),
                "no base64": ("&&&", "not base64"),
            }
            for payload, says in bad.values():
                with pytest.raises(openai.BadRequestError, match=says):
                    await _complete(c, payload)
            with pytest.raises(openai.BadRequestError, match="not both"):
                await c.completions.create(
                    model=MODEL, prompt="Hi", max_tokens=2, extra_body={"prompt_embeds": _torch_saved(embeds)}
                )
            with pytest.raises(openai.BadRequestError, match="echo"):
                await _complete(c, _torch_saved(embeds), echo=True)
            # The worker is still there.
            again = await _complete(c, _torch_saved(embeds))
            assert again.choices[0].text == done.choices[0].text
    finally:
        await stop()
