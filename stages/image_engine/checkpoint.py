"""Text-to-image checkpoints: a diffusers pipeline folder (``model_index.json``
and a folder per part), or the built-in ``tiny-sd``: a Stable Diffusion
pipeline of random weights a few hundred KB in all, built offline from
config as the tiny VLMs are, so CPU tests draw in milliseconds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from schemas.errors import ModelNotFound
from stages.models.builtin import MARKER_FILE, SEED, cached_dir, mmpipe_home

TINY_TEXT_TO_IMAGE = "tiny-sd"
# Bump when the builder's output changes: cached copies are rebuilt.
BUILDER_VERSION = 1
# The tiny pipeline's parts: a 2-block UNet over 4 latent channels, a VAE
# that halves each side, CLIP's text encoder at 32 wide over a byte vocabulary.
_WIDTH = 32
_LATENT = 4


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte (CLIP's BPE alphabet)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols = {b: chr(b) for b in kept}
    spare = 256
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(spare)
            spare += 1
    return [symbols[b] for b in range(256)]


# Stable Diffusion 1.5's architecture at its own sizes (about 1.07 B parameters), for
# measuring on a GPU with random weights (``mmpipe bench images``); the byte
# tokenizer stands in for CLIP's vocabulary, which is the only size changed.
SD15_SHAPE = "sd15-shape"


def build_tiny_text_to_image(out_dir: Path) -> None:
    _build_text_to_image(out_dir, sd15=False)


def build_sd15_shape(out_dir: Path, dtype: str = "bfloat16") -> None:
    _build_text_to_image(out_dir, sd15=True, dtype=dtype)


def _build_text_to_image(out_dir: Path, sd15: bool, dtype: str = "float32") -> None:
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    # No merges: every byte a token (a word's last byte with "</w>"), no files to ship.
    symbols = _byte_symbols()
    vocab = {s: i for i, s in enumerate(symbols)} | {s + "</w>": 256 + i for i, s in enumerate(symbols)}
    vocab |= {"<|startoftext|>": 512, "<|endoftext|>": 513}
    tokenizer = CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)
    torch.manual_seed(SEED)
    width = 768 if sd15 else _WIDTH
    unet = UNet2DConditionModel(
        sample_size=64 if sd15 else 32,
        in_channels=_LATENT,
        out_channels=_LATENT,
        block_out_channels=(320, 640, 1280, 1280) if sd15 else (4, 8),
        layers_per_block=2 if sd15 else 1,
        down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",)
        if sd15
        else ("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3 if sd15 else ("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=width,
        attention_head_dim=8 if sd15 else 2,
        norm_num_groups=32 if sd15 else 2,
    )
    vae_blocks = (128, 256, 512, 512) if sd15 else (4, 8)
    vae = AutoencoderKL(
        sample_size=512 if sd15 else 64,
        in_channels=3,
        out_channels=3,
        block_out_channels=vae_blocks,
        down_block_types=("DownEncoderBlock2D",) * len(vae_blocks),
        up_block_types=("UpDecoderBlock2D",) * len(vae_blocks),
        layers_per_block=2 if sd15 else 1,
        latent_channels=_LATENT,
        norm_num_groups=32 if sd15 else 2,
    )
    text = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(vocab),
            hidden_size=width,
            intermediate_size=3072 if sd15 else 37,
            num_hidden_layers=12 if sd15 else 2,
            num_attention_heads=12 if sd15 else 4,
            max_position_embeddings=77,
            projection_dim=width,
            bos_token_id=512,
            eos_token_id=513,
            pad_token_id=513,
        )
    )
    # Stable Diffusion's schedule; steps_offset=1 as its scheduler configs have it.
    scheduler = DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    pipeline: Any = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipeline.to(getattr(torch, dtype)).save_pretrained(out_dir)


def image_model_path(spec: str) -> Path:
    """The built-in ``tiny-sd`` (built on first use under $MMPIPE_HOME/models),
    or a diffusers pipeline folder."""
    if spec == TINY_TEXT_TO_IMAGE:
        marker = {"name": spec, "builder_version": BUILDER_VERSION}

        def build(out_dir: Path) -> None:
            build_tiny_text_to_image(out_dir)
            (out_dir / MARKER_FILE).write_text(json.dumps(marker) + "\n")

        return cached_dir(mmpipe_home() / "models" / spec, marker, build)
    path = Path(spec).expanduser()
    if not (path / "model_index.json").is_file():
        raise ModelNotFound(
            f"image model {spec!r}: not a diffusers pipeline folder (no model_index.json) "
            f"and not the built-in {TINY_TEXT_TO_IMAGE}"
        )
    return path.resolve()
