"""What the engine tests share: an engine on the test device, a chat
prompt's token ids, greedy sampling of n tokens, decoding a prefilled
sequence to n tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from stages.sampling import SamplingConfig
from stages.torch_engine.engine import TorchEngine
from stages.torch_engine.settings import DecodeSettings


def engine_on(device: str, model_dir: Path, decode: DecodeSettings | None = None) -> TorchEngine:
    """An engine on the ``engine_device`` fixture's device, in float32 (the
    tiny models' and the reference's dtype; the engine's own default on
    CUDA is bf16). ``decode`` as the engine defaults it otherwise: on CUDA
    the batch decoder captures CUDA graphs and runs the compiled fused step."""
    engine = TorchEngine(model_dir, device=device, dtype=torch.float32, decode=decode)
    assert engine.model.device.type == torch.device(device).type
    return engine


def chat_prompt(engine: TorchEngine, content: list[dict[str, str]]) -> list[int]:
    text = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return list(engine.tokenizer(text, add_special_tokens=False)["input_ids"])


def greedy(n: int) -> SamplingConfig:
    return SamplingConfig(temperature=0.0, max_tokens=n, min_tokens=n)


def decode(engine: TorchEngine, seq: Any, first: int, n: int) -> list[int]:
    out = [first]
    while len(out) < n:
        out += engine.step([seq])
    return out
