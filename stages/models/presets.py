"""Real-size model shapes with random weights, for benchmarks on a GPU.

``qwen2-vl-2b`` and ``qwen2-vl-7b`` are Qwen2-VL-2B/7B-Instruct's shapes
(vision tower, language model, vocabulary); the weights are random (seeded),
so the text is gibberish but every kernel does the real work. ``mmpipe model
build --preset NAME --out DIR`` writes a checkpoint directory the engine and
``mmpipe up --model DIR`` load like a real one; ``mmpipe bench decode``
builds them in memory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stages.models.builtin import copy_qwen_tokenizer, qwen_vl_preprocessor
from stages.models.tokenizer import QWEN2_ADDED_TOKEN_IDS

_VISION = {
    "depth": 32,
    "embed_dim": 1280,
    "num_heads": 16,
    "mlp_ratio": 4,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "in_channels": 3,
}
_SMOKE_VISION = {"depth": 2, "embed_dim": 64, "num_heads": 4}
PRESETS: dict[str, dict[str, Any]] = {
    "qwen2-vl-2b": {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    # Tiny shapes of the same structure: a quick check of a benchmark itself, anywhere.
    "qwen2-vl-smoke": {
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "qwen2-vl-7b": {
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    },
}
MAX_POSITIONS = 32768


def preset_config(name: str) -> Any:
    from transformers import Qwen2VLConfig

    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    text = dict(PRESETS[name])
    tie = text.pop("tie_word_embeddings")
    rope = {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [16, 24, 24]}
    return Qwen2VLConfig(
        text_config={
            **text,
            "max_position_embeddings": MAX_POSITIONS,
            "rope_parameters": rope,
            "tie_word_embeddings": tie,
            "use_sliding_window": False,
            "eos_token_id": QWEN2_ADDED_TOKEN_IDS["<|im_end|>"],
        },
        vision_config={**_VISION, **_SMOKE_VISION, "hidden_size": text["hidden_size"]}
        if name.endswith("smoke")
        else {**_VISION, "hidden_size": text["hidden_size"]},
        image_token_id=QWEN2_ADDED_TOKEN_IDS["<|image_pad|>"],
        video_token_id=QWEN2_ADDED_TOKEN_IDS["<|video_pad|>"],
        vision_start_token_id=QWEN2_ADDED_TOKEN_IDS["<|vision_start|>"],
        vision_end_token_id=QWEN2_ADDED_TOKEN_IDS["<|vision_end|>"],
        tie_word_embeddings=tie,
        architectures=["Qwen2VLForConditionalGeneration"],
    )


def build_preset_model(name: str, device: str = "cuda", seed: int = 0) -> Any:
    """The model in memory, bf16, on ``device``, with seeded random weights."""
    import torch
    from transformers import Qwen2VLForConditionalGeneration

    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2VLForConditionalGeneration._from_config(preset_config(name), dtype=torch.bfloat16)
    return model.eval()


def build_preset(name: str, out_dir: Path, device: str = "cuda") -> Path:
    """A checkpoint directory of the preset: weights, config, tokenizer, preprocessor."""
    from transformers import GenerationConfig

    model = build_preset_model(name, device)
    eos = [QWEN2_ADDED_TOKEN_IDS["<|im_end|>"], QWEN2_ADDED_TOKEN_IDS["<|endoftext|>"]]
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=QWEN2_ADDED_TOKEN_IDS["<|endoftext|>"])
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    preprocessor = qwen_vl_preprocessor(min_pixels=56 * 56, max_pixels=28 * 28 * 1280)
    (out_dir / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2) + "\n")
    copy_qwen_tokenizer(out_dir, model_max_length=MAX_POSITIONS)
    return out_dir
