"""Real-size presets: their shapes are Qwen2-VL-2B/7B's, and `mmpipe model
build --preset` writes a checkpoint the engine serves (tiny shapes here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.cli import main
from stages.models.presets import preset_config
from stages.sampling import SamplingConfig
from stages.torch_engine.engine import TorchEngine


def test_preset_shapes_are_qwen2_vl_2b_and_7b() -> None:
    two, seven = preset_config("qwen2-vl-2b"), preset_config("qwen2-vl-7b")
    shape = lambda c: (c.text_config.hidden_size, c.text_config.num_hidden_layers, c.text_config.num_key_value_heads)  # noqa: E731
    assert (shape(two), shape(seven)) == ((1536, 28, 2), (3584, 28, 4))
    assert (two.vision_config.depth, two.vision_config.embed_dim) == (32, 1280)
    assert two.tie_word_embeddings and not seven.tie_word_embeddings
    with pytest.raises(KeyError, match="qwen2-vl-2b"):
        preset_config("qwen2-vl-72b")


def test_model_build_preset_writes_a_checkpoint_the_engine_serves(tmp_path: Path) -> None:
    out = tmp_path / "smoke"
    assert main(["model", "build", "--preset", "qwen2-vl-smoke", "--device", "cpu", "--out", str(out)]) == 0
    engine = TorchEngine(out)
    prompt = engine.tokenizer("hello")["input_ids"]
    [(seq, first)] = engine.prefill([prompt], [[]], [SamplingConfig(max_tokens=3, min_tokens=3)])
    assert len([first, *engine.step([seq]), *engine.step([seq])]) == 3
    assert engine.family.name == "qwen2_vl" and engine.model.config.text_config.hidden_size == 256
