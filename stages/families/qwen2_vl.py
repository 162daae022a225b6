"""Qwen2-VL and Qwen2.5-VL: image preprocessing, the vision tower call and
M-RoPE positions.

The engine drives the Hugging Face model class itself; this adapter only
feeds it what ``generate()`` would: the same token embeddings with the image
embeddings scattered in, the same 3-D (temporal, height, width) positions,
one forward over the whole prompt, then one forward per new token. That is
what makes greedy tokens identical to ``generate()``. Qwen2.5-VL differs in
its vision tower (window attention), which its model class owns.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from PIL import Image

try:  # transformers >= 5.x ships the PIL and torchvision backends as two classes.
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil as _ImageProcessor,
    )
except ImportError:  # older releases: Qwen2VLImageProcessor is the PIL/numpy one
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import (  # type: ignore[assignment]
        Qwen2VLImageProcessor as _ImageProcessor,
    )
from transformers import PretrainedConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

from stages.families.base import Grid, LanguageModelFamily, features_per_item


class Qwen2VLFamily(LanguageModelFamily):
    name: ClassVar[str] = "qwen2_vl"
    architectures: ClassVar[tuple[str, ...]] = ("Qwen2VLForConditionalGeneration",)
    _model_class: ClassVar[Any] = Qwen2VLForConditionalGeneration

    def __init__(self, model_dir: Path, config: PretrainedConfig) -> None:
        super().__init__(model_dir, config)
        self.image_processor = _ImageProcessor.from_pretrained(str(model_dir))
        self.merge_size = int(config.vision_config.spatial_merge_size)

    @property
    def model_class(self) -> Any:
        return self._model_class

    # -- images -------------------------------------------------------------

    def preprocess(self, images: list[Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
        """pixel_values [patches, C*T*P*P] (float32) and image_grid_thw [n, 3]."""
        out = self.image_processor(images=images, return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]

    def num_image_tokens(self, grid: Grid) -> int:
        t, h, w = grid
        return t * h * w // (self.merge_size**2)

    def embeddings_grid(self, grid: Grid, rows: int) -> Grid:
        if len(grid) != 3:
            raise ValueError("Qwen-VL embeddings need their 'grid' (t, h, w): positions depend on it")
        if grid[1] % self.merge_size or grid[2] % self.merge_size or self.num_image_tokens(grid) != rows:
            raise ValueError(f"grid {list(grid)} does not give {rows} tokens with spatial merge {self.merge_size}")
        return grid

    @torch.inference_mode()
    def encode(self, model: Any, images: list[Image.Image]) -> list[tuple[torch.Tensor, Grid]]:
        """Vision tower output per image: ([num_tokens, hidden], grid_thw)."""
        if not images:
            return []
        pixel_values, grid = self.preprocess(images)
        device = model.device
        out = model.get_image_features(pixel_values.to(device, model.dtype), grid.to(device))
        grids: list[Grid] = [(int(t), int(h), int(w)) for t, h, w in grid.tolist()]
        feats = features_per_item(out, [self.num_image_tokens(g) for g in grids])
        return list(zip(feats, grids, strict=True))

    # -- positions ------------------------------------------------------------

    def prompt_positions(self, token_ids: list[int], grids: list[Grid]) -> tuple[torch.Tensor, int]:
        """M-RoPE positions [3, 1, L] of an expanded prompt, and its rope delta.

        Text tokens advance all three rows together; an image block gets
        (t, h, w) grid coordinates offset by the position it starts at, and
        the text after it resumes at start + max(t, h, w) (merged grid). The
        delta (max position + 1 - L) shifts every later, text-only position.
        Images are assigned in order by their token counts, so two adjacent
        images stay two images.
        """
        n = len(token_ids)
        ids = torch.tensor(token_ids, dtype=torch.long)
        positions = torch.empty(3, n, dtype=torch.long)
        is_image = (ids == self.image_token_id).tolist()
        cur = i = image = 0
        while i < n:
            if is_image[i]:
                t, h, w = grids[image]
                gh, gw = h // self.merge_size, w // self.merge_size
                count = t * gh * gw
                tt = torch.arange(t).repeat_interleave(gh * gw)
                hh = torch.arange(gh).repeat_interleave(gw).repeat(t)
                ww = torch.arange(gw).repeat(t * gh)
                positions[:, i : i + count] = torch.stack([tt, hh, ww]) + cur
                cur += max(t, gh, gw)
                i += count
                image += 1
            else:
                j = i
                while j < n and not is_image[j]:
                    j += 1
                positions[:, i:j] = torch.arange(j - i) + cur
                cur += j - i
                i = j
        return positions.unsqueeze(1), cur - n

    def decode_positions(self, position: int) -> torch.Tensor:
        # After the prompt every token is text: the same position in all three rows.
        return torch.full((3, 1, 1), position, dtype=torch.long)


class Qwen25VLFamily(Qwen2VLFamily):
    name: ClassVar[str] = "qwen2_5_vl"
    architectures: ClassVar[tuple[str, ...]] = ("Qwen2_5_VLForConditionalGeneration",)
    _model_class: ClassVar[Any] = Qwen2_5_VLForConditionalGeneration
