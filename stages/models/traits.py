"""What the processor needs of a checkpoint, read without loading weights."""

from __future__ import annotations

import json

from stages.models.resolve import ModelSpec
from stages.processor import ModelTraits


def load_traits(spec: ModelSpec) -> ModelTraits:
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(str(spec.path))
    text = config.get_text_config()
    pre_path = spec.path / "preprocessor_config.json"
    pre = json.loads(pre_path.read_text()) if pre_path.is_file() else {}
    patch = int(pre.get("patch_size", 14))
    merge = int(pre.get("merge_size", 2))
    min_pixels = int(pre.get("min_pixels") or (pre.get("size") or {}).get("shortest_edge") or (patch * merge) ** 2)
    return ModelTraits(
        served_name=spec.served_name,
        tokenizer=AutoTokenizer.from_pretrained(str(spec.path)),
        image_token_id=int(config.image_token_id),
        max_model_len=int(text.max_position_embeddings),
        # smart_resize never goes below min_pixels, so no image is smaller.
        min_tokens_per_image=max(1, min_pixels // (patch * merge) ** 2),
    )
