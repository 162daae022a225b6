"""The Qwen-VL towers' attention through ``varlen_attention``: one call per
layer for every image of the tower call, and the towers' own result (on the
CPU exactly, it attends image by image there; on a GPU in half precision
within rounding, through torch's flash ``varlen_attn``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AttentionInterface, AutoConfig

from stages.families import family_for_architecture, vision_attention
from stages.models import builtin_path
from tests.e2e.conftest import gradient


@pytest.fixture(params=["tiny-qwen2-vl", "tiny-qwen2.5-vl"])
def model_dir(request: pytest.FixtureRequest, mmpipe_home: Path) -> Path:
    return builtin_path(str(request.param))


def _tower_output(model_dir: Path, device: str, dtype: torch.dtype, packed: bool) -> tuple[torch.Tensor, int]:
    config = AutoConfig.from_pretrained(str(model_dir))
    family = family_for_architecture(config.architectures[0])(model_dir, config)
    model: Any = family.model_class.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    calls = 0
    if packed:
        vision_attention.use_packed_attention(model.model.visual.config)

        def counted(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            return vision_attention.varlen_attention(*args, **kwargs)

        AttentionInterface.register(vision_attention.NAME, counted)
    # Three images of three sizes: three sequences of different lengths.
    images = [gradient(56, 56, 1), gradient(84, 56, 2), gradient(112, 84, 3)]
    pixels, grid = family.preprocess(images)
    try:
        with torch.inference_mode():
            out = model.get_image_features(pixels.to(device, dtype), grid.to(device))
    finally:
        AttentionInterface.register(vision_attention.NAME, vision_attention.varlen_attention)
    feats = out.pooler_output if hasattr(out, "pooler_output") else out
    if isinstance(feats, (tuple, list)):
        feats = torch.cat(list(feats))
    return feats.float().cpu(), calls


def test_one_call_per_layer_for_all_images_and_the_towers_result(model_dir: Path, engine_device: str) -> None:
    dtype = torch.float32 if engine_device == "cpu" else torch.bfloat16
    want, _ = _tower_output(model_dir, engine_device, dtype, packed=False)
    got, calls = _tower_output(model_dir, engine_device, dtype, packed=True)
    layers = AutoConfig.from_pretrained(str(model_dir)).vision_config.depth
    assert calls == layers
    if engine_device == "cpu":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_the_engine_packs_only_where_varlen_attention_runs(engine_device: str) -> None:
    assert not vision_attention.available(torch.device("cpu"), torch.bfloat16)
    assert not vision_attention.available(torch.device("cuda"), torch.float32)
    if engine_device != "cpu":
        assert vision_attention.available(torch.device(engine_device), torch.bfloat16)


def test_anything_but_packed_bidirectional_attention_is_refused() -> None:
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="packed, bidirectional"):
        vision_attention.varlen_attention(None, q, q, q, None)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="packed, bidirectional"):
        vision_attention.varlen_attention(None, q, q, q, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, is_causal=True)
