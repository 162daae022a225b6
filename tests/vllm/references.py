"""generate()'s tokens for the vLLM tests' video request (the image and text
references are tests.e2e.conftest.make_reference)."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import numpy as np
from transformers import AutoConfig, AutoTokenizer

from stages.media import MediaPolicy, VideoOptions, decode_video
from stages.torch_engine.reference import reference_generate
from tests.stages.test_media_av import encode_video


def _noise(i: int, size: tuple[int, int]) -> Any:
    return (np.random.RandomState(i).rand(size[1], size[0], 3) * 255).astype("uint8")


def _clip() -> bytes:
    return encode_video(n=12, size=(96, 64), fps=6, frames=_noise)


def video_content() -> list[dict[str, Any]]:
    """A 2 s clip sampled at 3 fps, as the openai client sends it."""
    url = f"data:video/mp4;base64,{base64.b64encode(_clip()).decode()}"
    return [{"type": "video_url", "video_url": {"url": url, "fps": 3.0}}, {"type": "text", "text": "Describe it."}]


def video_request(model_dir: Path, n: int) -> tuple[list[dict[str, Any]], tuple[str, list[int]]]:
    """``video_content()`` and generate()'s (text, tokens) of n greedy tokens for it."""
    data = _clip()
    content = video_content()
    pad = int(AutoConfig.from_pretrained(str(model_dir)).vision_config.temporal_patch_size)
    video = decode_video(data, MediaPolicy(), VideoOptions(fps=3.0, pad_to_multiple=pad))
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    messages = [{"role": "user", "content": [{"type": "video", "video": ""}, {"type": "text", "text": "Describe it."}]}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    tokens = reference_generate(model_dir, prompt, [video], max_new_tokens=n, min_new_tokens=n)
    return content, (str(tokenizer.decode(tokens, skip_special_tokens=True)), tokens)
