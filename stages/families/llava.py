"""LLaVA-1.5: a CLIP vision tower and a projector in front of a decoder-only
language model with plain 1-D positions.

Each image is resized and centre-cropped to the tower's input size, so every
image becomes the same number of tokens (576 for a 336-pixel, patch-14
tower); the family reads that count from the config, not from the image.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from PIL import Image
from transformers import LlavaForConditionalGeneration, PretrainedConfig

from schemas.processed import MediaKind
from stages.device_copy import to_device
from stages.families.base import (
    Grid,
    LanguageModelFamily,
    Media,
    MediaEmbedding,
    encode_by_kind,
    features_per_item,
)

try:  # transformers 5.x: the PIL backend has its own class (the default one needs torchvision).
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil as _ImageProcessor
except ImportError:  # older releases: CLIPImageProcessor is the PIL/numpy one
    from transformers import CLIPImageProcessor as _ImageProcessor  # type: ignore[assignment]


def llava_tokens_per_image(config: PretrainedConfig) -> int:
    vision = config.vision_config
    patches = (int(vision.image_size) // int(vision.patch_size)) ** 2
    # "default" drops the CLS token; "full" keeps it.
    return patches + (1 if config.vision_feature_select_strategy == "full" else 0)


class LlavaFamily(LanguageModelFamily):
    name: ClassVar[str] = "llava"
    architectures: ClassVar[tuple[str, ...]] = ("LlavaForConditionalGeneration",)

    def __init__(self, model_dir: Path, config: PretrainedConfig) -> None:
        super().__init__(model_dir, config)
        self.image_processor = _ImageProcessor.from_pretrained(str(model_dir))
        self.tokens_per_image = llava_tokens_per_image(config)

    @classmethod
    def placeholders_of(cls, config: PretrainedConfig) -> dict[MediaKind, int]:
        return {MediaKind.IMAGE: int(config.image_token_id)}

    @property
    def model_class(self) -> Any:
        return LlavaForConditionalGeneration

    def num_tokens(self, item: MediaEmbedding) -> int:
        return self.tokens_per_image

    def embeddings_grid(self, grid: Grid, rows: int) -> Grid:
        if rows != self.tokens_per_image:
            raise ValueError(f"{rows} embedding rows; this model's images are {self.tokens_per_image} tokens")
        return (self.tokens_per_image,)

    @torch.inference_mode()
    def encode(self, model: Any, media: list[Media]) -> list[MediaEmbedding]:
        return encode_by_kind(media, {MediaKind.IMAGE: lambda images: self._encode_images(model, images)}, self.name)

    def _encode_images(self, model: Any, images: list[Image.Image]) -> list[MediaEmbedding]:
        """Projected vision features per image: [tokens_per_image, hidden], grid (tokens,)."""
        pixel_values = self.image_processor(images=images, return_tensors="pt")["pixel_values"]
        out = model.get_image_features(pixel_values=to_device(pixel_values, model.device, model.dtype))
        feats = features_per_item(out, [self.tokens_per_image] * len(images))
        return [MediaEmbedding(f, (self.tokens_per_image,), MediaKind.IMAGE) for f in feats]
