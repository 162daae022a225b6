"""Every family's built-in tiny model on the engine: greedy tokens equal
transformers generate() exactly, in one engine and across a KV hand-off."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from schemas.processed import MediaKind
from stages.models import builtin_path
from stages.torch_engine.engine import TorchEngine
from stages.torch_engine.reference import load_reference_model, reference_generate
from tests.stages.engine_helpers import chat_prompt, decode, engine_on, greedy

N_NEW = 12
FAMILIES = {"tiny-qwen2.5-vl": "qwen2_5_vl", "tiny-llava": "llava"}


@pytest.fixture(scope="module", params=list(FAMILIES))
def loaded(
    request: pytest.FixtureRequest, mmpipe_home: Path, engine_device: str
) -> tuple[Path, TorchEngine, TorchEngine, Any]:
    model_dir = builtin_path(request.param)
    # Two engines: what a prefill and a decode worker each hold.
    engine, other = engine_on(engine_device, model_dir), engine_on(engine_device, model_dir)
    return model_dir, engine, other, load_reference_model(model_dir, device=engine_device)


def _images() -> list[Image.Image]:
    rng = np.random.default_rng(3)
    return [
        Image.fromarray(rng.integers(0, 256, (120, 90, 3), dtype=np.uint8)),
        Image.fromarray(rng.integers(0, 256, (60, 150, 3), dtype=np.uint8)),
    ]


def _prompt(engine: TorchEngine, n_images: int) -> list[int]:
    content: list[dict[str, str]] = [{"type": "image"}] * n_images + [{"type": "text", "text": "What is shown? 😀"}]
    return chat_prompt(engine, content)


@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_greedy_equals_generate_in_one_engine_and_across_a_hand_off(loaded: Any, n_images: int) -> None:
    model_dir, engine, other, ref_model = loaded
    images = _images()[:n_images]
    prompt = _prompt(engine, n_images)
    assert prompt.count(engine.family.placeholder_ids[MediaKind.IMAGE]) == n_images
    expected = reference_generate(model_dir, prompt, images, N_NEW, model=ref_model)
    encoded = engine.encode(images)
    [(seq, first)] = engine.prefill([prompt], [encoded], [greedy(N_NEW)])
    assert decode(engine, seq, first, N_NEW) == expected
    [(seq, first)] = engine.prefill([prompt], [encoded], [greedy(N_NEW)])
    tensors, state = engine.export_kv(seq)
    engine.release(seq)
    moved = other.import_kv([t.clone() for t in tensors], state, greedy(N_NEW))
    assert decode(other, moved, first, N_NEW) == expected


def test_outputs_depend_on_the_images(loaded: Any) -> None:
    model_dir, engine, _, ref_model = loaded
    prompt = _prompt(engine, 1)
    a, b = _images()
    outputs = {tuple(reference_generate(model_dir, prompt, [im], N_NEW, model=ref_model)) for im in (a, b)}
    assert len(outputs) == 2
