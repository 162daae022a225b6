"""What is Qwen2-VL specific: image preprocessing, the vision tower call,
placeholder expansion, M-RoPE positions and the language-model forward.

The engine drives the Hugging Face model class itself; this adapter only
feeds it what ``generate()`` would: the same token embeddings with the image
embeddings scattered in, the same 3-D (temporal, height, width) positions,
one forward over the whole prompt, then one forward per new token. That is
what makes greedy tokens identical to ``generate()``.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

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
from transformers import PretrainedConfig, Qwen2VLForConditionalGeneration

# transformers 5.24 renamed the forward's `past_key_values` to `cache` (the old
# name warns until 5.40); 5.17 only knows `past_key_values`.
_CACHE_KWARG = (
    "cache" if "cache" in inspect.signature(Qwen2VLForConditionalGeneration.forward).parameters else "past_key_values"
)


class Qwen2VLFamily:
    name = "qwen2_vl"
    architectures = ("Qwen2VLForConditionalGeneration",)
    model_class = Qwen2VLForConditionalGeneration

    def __init__(self, model_dir: Path, config: PretrainedConfig) -> None:
        self.image_processor = _ImageProcessor.from_pretrained(str(model_dir))
        self.image_token_id = int(config.image_token_id)
        self.merge_size = int(config.vision_config.spatial_merge_size)
        text_config = config.get_text_config()
        self.hidden_size = int(text_config.hidden_size)
        self.vocab_size = int(text_config.vocab_size)
        self.max_position_embeddings = int(text_config.max_position_embeddings)
        # The KV cache's shape, checked when one arrives from another worker.
        self.num_hidden_layers = int(text_config.num_hidden_layers)
        self.num_key_value_heads = int(text_config.num_key_value_heads)
        heads = int(text_config.num_attention_heads)
        self.head_dim = int(getattr(text_config, "head_dim", None) or self.hidden_size // heads)

    # -- images -------------------------------------------------------------

    def preprocess(self, images: list[Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
        """pixel_values [patches, C*T*P*P] (float32) and image_grid_thw [n, 3]."""
        out = self.image_processor(images=images, return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]

    def num_image_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        t, h, w = grid_thw
        return t * h * w // (self.merge_size**2)

    @torch.inference_mode()
    def encode(self, model: Any, images: list[Image.Image]) -> list[tuple[torch.Tensor, tuple[int, int, int]]]:
        """Vision tower output per image: ([num_tokens, hidden], grid_thw)."""
        if not images:
            return []
        pixel_values, grid = self.preprocess(images)
        device = model.device
        out = model.get_image_features(pixel_values.to(device), grid.to(device))
        # 5.24 returns a BaseModelOutputWithPooling whose pooler_output holds the
        # per-image split; older releases returned the split (or one tensor).
        feats = out.pooler_output if hasattr(out, "pooler_output") else out
        grids = [(int(t), int(h), int(w)) for t, h, w in grid.tolist()]
        if isinstance(feats, torch.Tensor):
            feats = torch.split(feats, [self.num_image_tokens(g) for g in grids])
        return [(f, g) for f, g in zip(feats, grids, strict=True)]

    # -- prompt -------------------------------------------------------------

    def expand_placeholders(self, token_ids: list[int], num_tokens: list[int]) -> list[int]:
        """Replace the i-th image placeholder with num_tokens[i] copies of it."""
        out: list[int] = []
        image = 0
        for tok in token_ids:
            if tok == self.image_token_id:
                if image >= len(num_tokens):
                    raise ValueError(f"prompt has more image placeholders than the {len(num_tokens)} images given")
                out.extend([tok] * num_tokens[image])
                image += 1
            else:
                out.append(tok)
        if image != len(num_tokens):
            raise ValueError(f"prompt has {image} image placeholders but {len(num_tokens)} images were given")
        return out

    def prompt_positions(self, token_ids: list[int], grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, int]:
        """M-RoPE positions [3, L] of an expanded prompt, and its rope delta.

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
        return positions, cur - n

    # -- language model -------------------------------------------------------

    @torch.inference_mode()
    def embed_prompt(self, model: Any, token_ids: list[int], image_embeds: list[torch.Tensor]) -> torch.Tensor:
        """Token embeddings [1, L, hidden] with image embeddings scattered over the placeholders."""
        ids = torch.tensor([token_ids], dtype=torch.long, device=model.device)
        embeds = model.get_input_embeddings()(ids)
        if image_embeds:
            feats = torch.cat(image_embeds, dim=0).to(embeds.device, embeds.dtype)
            mask = (ids == self.image_token_id).unsqueeze(-1).expand_as(embeds)
            embeds = embeds.masked_scatter(mask, feats)
        return embeds

    @torch.inference_mode()
    def forward(
        self,
        model: Any,
        positions: torch.Tensor,
        cache: Any,
        *,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Any]:
        """Run the language model over new tokens; return (last-token logits [vocab], cache).

        positions is [3, new] (batch of one). Explicit positions keep the
        model from computing them from its own `rope_deltas` attribute, which
        is per model instance, not per sequence.
        """
        out = model(
            input_ids=input_ids,
            inputs_embeds=inputs_embeds,
            position_ids=positions.to(model.device).unsqueeze(1),
            use_cache=True,
            logits_to_keep=1,
            **{_CACHE_KWARG: cache},
        )
        new_cache = getattr(out, "cache", None)
        if new_cache is None:
            new_cache = out.past_key_values
        return out.logits[0, -1], new_cache
