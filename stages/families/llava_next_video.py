"""LLaVA-NeXT-Video: each sampled frame goes through a CLIP vision tower, is
pooled spatially (``spatial_pool_stride``) and projected; a video is its
frames' tokens end to end, placed over the ``<video>`` placeholder. The
language model is decoder-only with plain 1-D positions.

Frames are prepared as the checkpoint's video processor prepares them
(resize to the shortest edge, centre crop, CLIP normalisation), by the PIL
CLIP image processor: Hugging Face's video processor needs torchvision.
Images (LLaVA-NeXT's any-resolution tiling) are not run by this adapter.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any, ClassVar

import torch
from transformers import LlavaNextVideoForConditionalGeneration, PretrainedConfig

from schemas.processed import MediaKind
from stages.device_copy import to_device
from stages.families.base import LanguageModelFamily, Media, MediaEmbedding, encode_by_kind
from stages.media import DecodedVideo

try:  # transformers 5.x: the PIL backend has its own class (the default one needs torchvision).
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil as _ImageProcessor
except ImportError:  # older releases: CLIPImageProcessor is the PIL/numpy one
    from transformers import CLIPImageProcessor as _ImageProcessor  # type: ignore[assignment]

# What of a video processor's config prepares a frame.
_FRAME_KEYS = (
    "size",
    "crop_size",
    "do_resize",
    "do_center_crop",
    "do_rescale",
    "rescale_factor",
    "do_normalize",
    "image_mean",
    "image_std",
    "resample",
    "do_convert_rgb",
)


class LlavaNextVideoFamily(LanguageModelFamily):
    name: ClassVar[str] = "llava_next_video"
    architectures: ClassVar[tuple[str, ...]] = ("LlavaNextVideoForConditionalGeneration",)

    def __init__(self, model_dir: Path, config: PretrainedConfig) -> None:
        super().__init__(model_dir, config)
        self.frame_processor = _frame_processor(model_dir)
        self.feature_layer = config.vision_feature_layer
        self.select_strategy = config.vision_feature_select_strategy

    @classmethod
    def placeholders_of(cls, config: PretrainedConfig) -> dict[MediaKind, int]:
        return {MediaKind.VIDEO: int(config.video_token_index)}

    @property
    def model_class(self) -> Any:
        return LlavaNextVideoForConditionalGeneration

    def num_tokens(self, item: MediaEmbedding) -> int:
        frames, per_frame = item.grid_thw
        return frames * per_frame

    @torch.inference_mode()
    def encode(self, model: Any, media: list[Media]) -> list[MediaEmbedding]:
        return encode_by_kind(media, {MediaKind.VIDEO: lambda videos: self._encode_videos(model, videos)}, self.name)

    def _encode_videos(self, model: Any, videos: list[DecodedVideo]) -> list[MediaEmbedding]:
        """One tower call for videos of one frame count (generate() stacks a
        request's videos into one [videos, frames, C, H, W] batch)."""
        out: dict[int, MediaEmbedding] = {}
        for frames in sorted({len(v.frames) for v in videos}):
            group = [i for i, v in enumerate(videos) if len(v.frames) == frames]
            pixels = torch.stack(
                [self.frame_processor(images=videos[i].frames, return_tensors="pt")["pixel_values"] for i in group]
            )
            features = model.get_video_features(
                **{_video_pixels_kwarg(model): to_device(pixels, model.device, model.dtype)},
                vision_feature_layer=self.feature_layer,
                vision_feature_select_strategy=self.select_strategy,
            )
            rows = _video_rows(features)
            feats = list(torch.split(rows, rows.shape[0] // len(group)))
            for i, f in zip(group, feats, strict=True):
                out[i] = MediaEmbedding(f, (frames, f.shape[0] // frames), MediaKind.VIDEO)
        return [out[i] for i in range(len(videos))]


def _video_rows(features: Any) -> torch.Tensor:
    """The videos' pooled features as rows, video after video: transformers
    5.24 returns them as one tensor (pooler_output), 5.17 as a tuple of parts."""
    feats = features.pooler_output if hasattr(features, "pooler_output") else features
    if isinstance(feats, (tuple, list)):
        feats = torch.cat([f.reshape(-1, f.shape[-1]) for f in feats])
    return feats.reshape(-1, feats.shape[-1])


def _frame_processor(model_dir: Path) -> Any:
    """A CLIP image processor configured as the checkpoint's video processor
    (video_preprocessor_config.json; else its preprocessor_config.json)."""
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        path = model_dir / name
        if path.is_file():
            config = json.loads(path.read_text())
            return _ImageProcessor(**{key: config[key] for key in _FRAME_KEYS if key in config})
    raise FileNotFoundError(f"{model_dir} has no video_preprocessor_config.json or preprocessor_config.json")


def _video_pixels_kwarg(model: Any) -> str:
    # transformers 5.17 names get_video_features' frames `pixel_values`, later
    # releases `pixel_values_videos` (seen on the GPU host, which has 5.17).
    params = inspect.signature(type(model).get_video_features).parameters
    return "pixel_values_videos" if "pixel_values_videos" in params else "pixel_values"
