"""What the engine tests share: a chat prompt's token ids, greedy sampling
of n tokens, decoding a prefilled sequence to n tokens."""

from __future__ import annotations

from typing import Any

from stages.engine.sampling import SamplingConfig
from stages.engine.torch_engine import TorchEngine


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
