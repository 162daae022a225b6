"""The project's reference: plain transformers ``generate()`` on a checkpoint.

Tests and benchmarks compare the engine with this. It shares none of the
engine's code paths: it loads the model and the (PIL) image processor
itself, expands ``<|image_pad|>`` to ``grid_thw.prod() // merge_size**2``
copies, builds ``mm_token_type_ids`` and lets ``generate()`` compute
everything else (vision tower, M-RoPE positions, cache).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch
from PIL import Image


def load_reference_model(model_dir: Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Any:
    from transformers import Qwen2VLForConditionalGeneration

    model: Any = Qwen2VLForConditionalGeneration.from_pretrained(str(model_dir), dtype=dtype)
    return model.to(device).eval()


def _image_processor(model_dir: Path) -> Any:
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as cls
    except ImportError:  # older transformers: the numpy/PIL processor has the plain name
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import (  # type: ignore[assignment]
            Qwen2VLImageProcessor as cls,
        )
    return cls.from_pretrained(str(model_dir))


def reference_generate(
    model_dir: Path,
    prompt_token_ids: list[int],
    images: list[Image.Image],
    max_new_tokens: int,
    min_new_tokens: int | None = None,
    model: Any = None,
) -> list[int]:
    """Greedy new tokens of ``generate()``.

    prompt_token_ids holds one ``<|image_pad|>`` per image. min_new_tokens
    defaults to max_new_tokens (random weights may emit EOS early). Pass an
    already loaded `model` (from load_reference_model) to skip loading.
    """
    model = model if model is not None else load_reference_model(model_dir)
    image_token_id = int(model.config.image_token_id)
    kwargs: dict[str, Any] = {}
    ids = list(prompt_token_ids)
    if images:
        processed = _image_processor(model_dir)(images=images, return_tensors="pt")
        grid = processed["image_grid_thw"]
        merge = int(model.config.vision_config.spatial_merge_size)
        counts = (grid.prod(-1) // merge**2).tolist()
        if ids.count(image_token_id) != len(counts):
            raise ValueError(f"{ids.count(image_token_id)} image placeholders for {len(counts)} images")
        expanded: list[int] = []
        for tok in ids:
            if tok == image_token_id:
                expanded.extend([tok] * counts.pop(0))
            else:
                expanded.append(tok)
        ids = expanded
        kwargs["pixel_values"] = processed["pixel_values"].to(model.device)
        kwargs["image_grid_thw"] = grid.to(model.device)
    input_ids = torch.tensor([ids], dtype=torch.long, device=model.device)
    # Without mm_token_type_ids generate() silently falls back to 1-D positions
    # (transformers 5.x); releases whose forward lacks it compute M-RoPE from
    # input_ids alone.
    if "mm_token_type_ids" in inspect.signature(model.forward).parameters:
        kwargs["mm_token_type_ids"] = (input_ids == image_token_id).to(torch.int32)
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens if min_new_tokens is None else min_new_tokens,
            **kwargs,
        )
    return [int(t) for t in out[0, input_ids.shape[1] :].tolist()]
