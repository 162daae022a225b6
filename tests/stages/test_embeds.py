"""Precomputed image embeddings: what a client made with the model's own
encoder gives exactly the tokens of generate() on the image itself, and a
payload that does not fit the model is refused with invalid_media."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

from schemas.errors import InvalidMedia
from schemas.request import (
    ChatMessage,
    GenerateRequest,
    ImageEmbeds,
    ImageEmbedsPart,
    ImagePart,
    ImageURL,
    SamplingParams,
    TextPart,
)
from stages.contract import HopContext
from stages.hop import HopStage
from stages.models import builtin_path, resolve_model
from stages.models.traits import load_traits
from stages.processor import Processor
from stages.torch_engine.engine import TorchEngine
from stages.torch_engine.hop_engine import TorchHopEngine
from stages.torch_engine.reference import load_reference_model, reference_generate
from tests.e2e.conftest import gradient, png_data_url
from tests.stages.engine_helpers import engine_on

N = 8


def payload(tensors: dict[str, torch.Tensor]) -> str:
    return "data:application/octet-stream;base64," + base64.b64encode(safetensors.torch.save(tensors)).decode()


@pytest.fixture(scope="module", params=["tiny-qwen2-vl", "tiny-llava"])
def name(request: pytest.FixtureRequest, mmpipe_home: Path) -> str:
    return str(request.param)


@pytest.fixture
async def stage(name: str, engine_device: str) -> AsyncIterator[HopStage]:
    role = "encode+prefill+decode"
    s = HopStage(role, TorchHopEngine(role, engine_on(engine_device, builtin_path(name))), name)
    await s.start()
    yield s
    await s.close()


def request(*parts: Any) -> GenerateRequest:
    return GenerateRequest(
        "e1", "m", [ChatMessage("user", [*parts, TextPart("What is it?")])], SamplingParams(N, 0.0, min_tokens=N)
    )


def torch_engine(stage: HopStage) -> TorchEngine:
    assert isinstance(stage.engine, TorchHopEngine)
    return stage.engine.torch


async def tokens(stage: HopStage, processor: Processor, req: GenerateRequest) -> list[int]:
    processed = processor.process(req)
    return [t async for c in stage.run(processed, HopContext()) for t in c.token_ids]  # type: ignore[union-attr]


async def test_embeddings_from_the_models_encoder_equal_generate_on_the_image(
    name: str, stage: HopStage, engine_device: str
) -> None:
    processor = Processor(load_traits(resolve_model(name, "m")))
    image = gradient(64, 48, 1)
    [encoded] = torch_engine(stage).encode([image])
    url = payload({"embeddings": encoded.embeddings, "grid": torch.tensor(encoded.grid_thw)})
    prompt = processor.process(request(ImagePart(ImageURL(png_data_url(image))))).prompt_token_ids
    reference = load_reference_model(builtin_path(name), device=engine_device)
    expected = reference_generate(builtin_path(name), prompt, [image], N, model=reference)
    assert await tokens(stage, processor, request(ImageEmbedsPart(ImageEmbeds(url)))) == expected
    # Mixed with an image sent as pixels: both reach the model.
    mixed = request(ImageEmbedsPart(ImageEmbeds(url)), ImagePart(ImageURL(png_data_url(gradient(30, 40, 2)))))
    assert len(await tokens(stage, processor, mixed)) == N


async def test_payloads_that_do_not_fit_the_model_are_refused(name: str, stage: HopStage) -> None:
    processor = Processor(load_traits(resolve_model(name, "m")))
    [encoded] = torch_engine(stage).encode([gradient(64, 48, 1)])
    emb, grid = encoded.embeddings, torch.tensor(encoded.grid_thw)
    nan = emb.clone()
    nan[0, 0] = float("nan")
    cases = {
        "not safetensors": "data:application/octet-stream;base64," + base64.b64encode(b"\x00" * 64).decode(),
        "wrong width": payload({"embeddings": torch.zeros(emb.shape[0], emb.shape[1] + 1), "grid": grid}),
        "wrong rows": payload({"embeddings": emb[:-1].contiguous(), "grid": grid}),
        "NaN": payload({"embeddings": nan, "grid": grid}),
        "stray tensor": payload({"embeddings": emb, "grid": grid, "pixels": torch.zeros(1)}),
        "int embeddings": payload({"embeddings": torch.zeros(emb.shape, dtype=torch.int32), "grid": grid}),
    }
    if name == "tiny-qwen2-vl":
        cases["no grid"] = payload({"embeddings": emb})
    for case, url in cases.items():
        with pytest.raises(InvalidMedia):
            await tokens(stage, processor, request(ImageEmbedsPart(ImageEmbeds(url))))
        assert InvalidMedia.http_status == 400, case
