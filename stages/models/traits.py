"""What the processor needs of a checkpoint, read without loading weights."""

from __future__ import annotations

import json
from typing import Any

from schemas.processed import MediaKind
from stages.families import family_for_architecture
from stages.models.resolve import ModelSpec
from stages.processor import ModelTraits


def load_traits(spec: ModelSpec) -> ModelTraits:
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(str(spec.path))
    text = config.get_text_config()
    family = family_for_architecture(config.architectures[0])
    placeholders = family.placeholders_of(config)
    return ModelTraits(
        served_name=spec.served_name,
        tokenizer=AutoTokenizer.from_pretrained(str(spec.path)),
        max_model_len=int(text.max_position_embeddings),
        placeholders=placeholders,
        min_tokens_per_image=_min_tokens_per_image(spec, config) if MediaKind.IMAGE in placeholders else 1,
        hidden_size=int(text.hidden_size),
        video_frame_multiple=family.video_frame_multiple_of(config),
    )


def _min_tokens_per_image(spec: ModelSpec, config: Any) -> int:
    if spec.family == "llava":
        # Every image is resized and cropped to the tower's input: a fixed count.
        vision = config.vision_config
        patches = (int(vision.image_size) // int(vision.patch_size)) ** 2
        return patches + (1 if config.vision_feature_select_strategy == "full" else 0)
    pre_path = spec.path / "preprocessor_config.json"
    pre = json.loads(pre_path.read_text()) if pre_path.is_file() else {}
    patch = int(pre.get("patch_size", 14))
    merge = int(pre.get("merge_size", 2))
    min_pixels = int(pre.get("min_pixels") or (pre.get("size") or {}).get("shortest_edge") or (patch * merge) ** 2)
    # smart_resize never goes below min_pixels, so no image is smaller.
    return max(1, min_pixels // (patch * merge) ** 2)
