"""The built-in engine's sleep mode (vLLM's): level 1 frees the KV pool
(and would move the weights to host memory on a GPU), level 2 drops the
weights; waking rebuilds what went, and the tokens are those of before."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest

from stages.sampling import SamplingConfig
from stages.torch_engine.engine import TorchEngine
from stages.torch_engine.reference import reference_generate
from tests.stages.engine_helpers import engine_on

N = 8


def _answer(engine: TorchEngine, prompt: list[int]) -> list[int]:
    [(seq, first)] = engine.prefill([prompt], [[]], [SamplingConfig(max_tokens=N, min_tokens=N)])
    out = [first]
    while len(out) < N:
        out += engine.step([seq])
    engine.release(seq)
    return out


def test_sleep_frees_the_kv_pool_or_the_weights_and_waking_gives_the_same_tokens(tiny_model_dir: Path) -> None:
    engine = engine_on("cpu", tiny_model_dir)
    prompt = list(engine.tokenizer("The sea and the mountains are")["input_ids"])
    expected = reference_generate(tiny_model_dir, prompt, [], N)
    assert _answer(engine, prompt) == expected
    held = engine.held_bytes()
    assert held["weights"] > 0 and held["kv_cache"] > 0
    assert engine.decoder is not None
    pool = weakref.ref(engine.decoder.keys)

    # Level 1: the pool is freed (on a CPU the weights are in host memory already).
    assert engine.sleep(1) == held
    gc.collect()
    assert pool() is None and engine.held_bytes() == {"weights": held["weights"], "kv_cache": 0}
    with pytest.raises(RuntimeError, match="sleeps already"):
        engine.sleep(2)
    engine.wake_up()
    assert engine.held_bytes() == held and engine.sleeping == 0
    assert _answer(engine, prompt) == expected

    # Level 2: the weights go too, and come back from the checkpoint.
    weight = weakref.ref(next(engine.model.parameters()))
    engine.sleep(2)
    gc.collect()
    assert weight() is None and engine.held_bytes() == {"weights": 0, "kv_cache": 0}
    engine.wake_up()
    assert engine.held_bytes() == held
    assert _answer(engine, prompt) == expected


def test_sleep_refuses_while_a_sequence_holds_the_pool_or_a_level_it_does_not_know(tiny_model_dir: Path) -> None:
    engine = engine_on("cpu", tiny_model_dir)
    prompt = list(engine.tokenizer("Hi")["input_ids"])
    [(seq, _)] = engine.prefill([prompt], [[]], [SamplingConfig(max_tokens=4)])
    engine.step([seq])  # in the batch decoder's pool now
    with pytest.raises(RuntimeError, match="hold the KV cache"):
        engine.sleep(1)
    engine.release(seq)
    with pytest.raises(ValueError, match="sleep level 3"):
        engine.sleep(3)
    assert engine.sleeping == 0 and engine.held_bytes()["kv_cache"] > 0
