"""The project's reference: plain transformers ``generate()`` on a checkpoint.

Tests and benchmarks compare the engine with this. It shares none of the
engine's code paths: it loads the model with the Auto class and the (PIL)
image processor itself, expands each image placeholder to as many copies as
the model's vision tower gives features (Qwen-VL: ``grid_thw.prod() //
merge_size**2``; LLaVA: one per patch), builds ``mm_token_type_ids`` where
the model takes them and lets ``generate()`` compute everything else
(vision tower, merge, positions, cache).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch
from PIL import Image


def load_reference_model(model_dir: Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Any:
    from transformers import AutoModelForImageTextToText

    model: Any = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=dtype)
    return model.to(device).eval()


def _qwen_image_processor(model_dir: Path) -> Any:
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as cls
    except ImportError:  # older transformers: the numpy/PIL processor has the plain name
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import (  # type: ignore[assignment]
            Qwen2VLImageProcessor as cls,
        )
    return cls.from_pretrained(str(model_dir))


def _clip_image_processor(model_dir: Path) -> Any:
    try:
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil as cls
    except ImportError:
        from transformers import CLIPImageProcessor as cls  # type: ignore[assignment]
    return cls.from_pretrained(str(model_dir))


def _image_inputs(model: Any, model_dir: Path, images: list[Image.Image]) -> tuple[dict[str, Any], list[int]]:
    """generate()'s image keyword arguments, and each image's token count."""
    config = model.config
    if config.model_type == "llava":
        pixels = _clip_image_processor(model_dir)(images=images, return_tensors="pt")["pixel_values"]
        patch = int(config.vision_config.patch_size)
        per_image = (pixels.shape[-2] // patch) * (pixels.shape[-1] // patch)
        per_image += 1 if config.vision_feature_select_strategy == "full" else 0
        return {"pixel_values": pixels}, [per_image] * len(images)
    processed = _qwen_image_processor(model_dir)(images=images, return_tensors="pt")
    grid = processed["image_grid_thw"]
    merge = int(config.vision_config.spatial_merge_size)
    counts = [int(c) for c in (grid.prod(-1) // merge**2).tolist()]
    return {"pixel_values": processed["pixel_values"], "image_grid_thw": grid}, counts


def reference_generate(
    model_dir: Path,
    prompt_token_ids: list[int],
    images: list[Image.Image],
    max_new_tokens: int,
    min_new_tokens: int | None = None,
    model: Any = None,
) -> list[int]:
    """Greedy new tokens of ``generate()``.

    prompt_token_ids holds one image placeholder per image. min_new_tokens
    defaults to max_new_tokens (random weights may emit EOS early). Pass an
    already loaded `model` (from load_reference_model) to skip loading.
    """
    model = model if model is not None else load_reference_model(model_dir)
    config = model.config
    image_token_id = int(getattr(config, "image_token_id", None) or config.image_token_index)
    kwargs: dict[str, Any] = {}
    ids = list(prompt_token_ids)
    if images:
        image_kwargs, counts = _image_inputs(model, model_dir, images)
        if ids.count(image_token_id) != len(counts):
            raise ValueError(f"{ids.count(image_token_id)} image placeholders for {len(counts)} images")
        expanded: list[int] = []
        for tok in ids:
            if tok == image_token_id:
                expanded.extend([tok] * counts.pop(0))
            else:
                expanded.append(tok)
        ids = expanded
        kwargs.update({k: v.to(model.device) for k, v in image_kwargs.items()})
    input_ids = torch.tensor([ids], dtype=torch.long, device=model.device)
    # Without mm_token_type_ids generate() silently falls back to 1-D positions
    # for Qwen-VL (transformers 5.x); releases whose forward lacks it compute
    # M-RoPE from input_ids alone, and LLaVA has no use for it.
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
