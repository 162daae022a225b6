"""The batch decoder: sequences that join and leave between steps, of
different lengths, with and without images, give exactly the tokens of the
per-sequence path (itself equal to generate()); what does not fit a slot
falls back to that path. On --engine-device cuda the decoder replays CUDA
graphs and its fused step is compiled."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from stages.models import builtin_path
from stages.sampling import SamplingConfig
from stages.torch_engine.decode_attention import varlen_reference
from stages.torch_engine.engine import TorchEngine
from stages.torch_engine.fused_decode import FusedKernels
from stages.torch_engine.reference import load_reference_model, reference_generate
from stages.torch_engine.settings import DecodeSettings
from tests.stages.engine_helpers import chat_prompt, engine_on

N = 16


@pytest.fixture(
    scope="module",
    params=[
        *((m, fused) for m in ("tiny-qwen2-vl", "tiny-llava", "tiny-qwen2-audio") for fused in ("modules", "fused")),
        ("tiny-qwen2-vl", "varlen"),
    ],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def engines(
    request: pytest.FixtureRequest, mmpipe_home: Path, engine_device: str
) -> tuple[str, TorchEngine, TorchEngine]:
    """A batch decoder on the model's modules (the CPU default), or on the
    fused layer step (the GPU default; eager on the CPU, compiled on CUDA),
    in CUDA graphs on CUDA, and an engine without one (each sequence on
    its own). "varlen": the fused step with the varlen attention of a GPU
    in half precision, here through its plain-torch contract."""
    name, step = request.param
    if step == "varlen" and engine_device != "cpu":
        pytest.skip("varlen_reference reads lengths on the host (no CUDA graphs): test_fused_decode has the kernel")
    model_dir = builtin_path(name)
    fused = step != "modules"
    batched = engine_on(engine_device, model_dir, DecodeSettings(slots=4, max_len=512, fused=fused))
    assert batched.decoder is not None and (batched.decoder.fused is not None) == fused
    if step == "varlen":
        batched.decoder.kernels = FusedKernels(compile=False, attention="flash", varlen=varlen_reference)
    assert batched.decoder.use_graphs == (torch.device(engine_device).type == "cuda")
    alone = engine_on(engine_device, model_dir, DecodeSettings(batched=False))
    assert batched.decoder is not None and alone.decoder is None
    return name, batched, alone


def _prompts(engine: TorchEngine, name: str) -> list[tuple[list[int], list[Any]]]:
    texts = ["Hi", "Tell me about the sea, the sky and everything between them.", "1 2 3", "Why?", "Name a colour."]
    out = []
    for text in texts:
        ids = engine.tokenizer(text)["input_ids"]
        out.append((list(ids), []))
    if name == "tiny-qwen2-vl":
        # An image moves every later position (M-RoPE's delta): the decoder must follow.
        image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (60, 90, 3), dtype=np.uint8))
        content = [{"type": "image", "image": ""}, {"type": "text", "text": "What is it?"}]
        out[1] = (chat_prompt(engine, content), engine.encode([image]))
    return out


def _alone(engine: TorchEngine, prompt: list[int], media: list[Any], sampling: SamplingConfig) -> list[int]:
    [(seq, first)] = engine.prefill([prompt], [media], [sampling])
    out = [first]
    while len(out) < sampling.max_tokens:
        out += engine.step([seq])
    engine.release(seq)
    return out


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_joining_and_leaving_gives_the_tokens_of_one_at_a_time(engines: Any, temperature: float) -> None:
    name, batched, alone = engines
    prompts = _prompts(batched, name)
    # Different lengths, so sequences finish at different steps and slots are refilled.
    samplings = [
        SamplingConfig(temperature=temperature, seed=7 + i, max_tokens=N - 2 * i, min_tokens=N - 2 * i)
        for i in range(len(prompts))
    ]
    expected = [_alone(alone, p, m, s) for (p, m), s in zip(prompts, samplings, strict=True)]
    outputs: dict[int, list[int]] = {}
    running: dict[int, Any] = {}
    pending = list(range(len(prompts)))
    while pending or running:
        # One joins per step (more than the 4 slots wait their turn in the per-sequence path).
        if pending:
            i = pending.pop(0)
            (prompt, media), sampling = prompts[i], samplings[i]
            [(seq, first)] = batched.prefill([prompt], [media], [sampling])
            outputs[i], running[i] = [first], seq
        tokens = batched.step(list(running.values()))
        for (i, seq), token in zip(list(running.items()), tokens, strict=True):
            outputs[i].append(token)
            if len(outputs[i]) == samplings[i].max_tokens:
                batched.release(seq)
                del running[i]
    assert [outputs[i] for i in range(len(prompts))] == expected
    assert batched._slots is not None and len(batched._slots) == 0


def test_steps_launched_one_ahead_give_the_tokens_of_one_at_a_time(engines: Any) -> None:
    """The decode loop's way (stages.torch_engine.scheduler): step k+1 is
    launched before step k's tokens are read, so every token after the first
    launch comes from the device; a sequence that ends takes one step more
    (dropped), and is freed while that step is launched: the last slot moves
    into its place with the launched step's write. EOS is masked on the
    device until min_tokens (here below max_tokens)."""
    name, batched, alone = engines
    prompts = _prompts(batched, name)
    samplings = [SamplingConfig(max_tokens=N - 2 * i, min_tokens=N // 2 - i) for i in range(len(prompts))]
    expected = [_alone(alone, p, m, s) for (p, m), s in zip(prompts, samplings, strict=True)]
    outputs: dict[int, list[int]] = {}
    running: dict[int, Any] = {}
    ahead: tuple[Any, list[tuple[int, Any]]] | None = None
    pending = list(range(len(prompts)))
    while pending or running or ahead:
        if pending and len(running) < 4:
            i = pending.pop(0)
            (prompt, media), sampling = prompts[i], samplings[i]
            [(seq, first)] = batched.prefill([prompt], [media], [sampling])
            outputs[i], running[i] = [first], seq
        batch = list(running.items())
        launch = batched.launch([seq for _, seq in batch]) if batch else None
        assert launch is not None or not batch
        if ahead is not None:
            launched, was = ahead
            for (i, seq), token in zip(was, batched.collect(launched), strict=True):
                if i not in running:
                    continue  # ended by the step before: this token is dropped
                outputs[i].append(token)
                assert seq.output_ids == outputs[i]
                if len(outputs[i]) == samplings[i].max_tokens:
                    batched.release(seq)
                    del running[i]
        ahead = (launch, batch) if launch is not None else None
    assert [outputs[i] for i in range(len(prompts))] == expected
    assert batched._slots is not None and len(batched._slots) == 0


def test_what_cannot_launch_steps_instead(engines: Any) -> None:
    _, batched, _ = engines
    prompt = batched.tokenizer("Sample me")["input_ids"]
    [(greedy, _)] = batched.prefill([prompt], [[]], [SamplingConfig(max_tokens=4)])
    [(sampled, _)] = batched.prefill([prompt], [[]], [SamplingConfig(temperature=0.8, max_tokens=4)])
    too_long = SamplingConfig(max_tokens=600)  # over the 512-token slots
    [(outside, _)] = batched.prefill([prompt], [[]], [too_long])
    assert batched.launch([greedy, sampled]) is None  # sampled on the host
    assert batched.launch([outside]) is None and outside.slot < 0
    launch = batched.launch([greedy])
    assert launch is not None and greedy.inflight == 1
    with pytest.raises(ValueError, match="not collected"):
        batched.step([greedy])
    [token] = batched.collect(launch)
    assert greedy.inflight == 0 and greedy.output_ids[-1] == token
    for seq in (greedy, sampled, outside):
        batched.release(seq)


def test_batched_decode_equals_generate(engines: Any, engine_device: str) -> None:
    name, batched, _ = engines
    model_dir = builtin_path(name)
    prompt, _ = _prompts(batched, name)[3]
    reference = load_reference_model(model_dir, device=engine_device)
    expected = reference_generate(model_dir, prompt, [], N, model=reference)
    assert _alone(batched, prompt, [], SamplingConfig(temperature=0.0, max_tokens=N, min_tokens=N)) == expected


def test_a_sequence_too_long_for_a_slot_decodes_on_its_own(engines: Any) -> None:
    _, batched, alone = engines
    prompt = batched.tokenizer("A long answer, please.")["input_ids"]
    sampling = SamplingConfig(temperature=0.0, max_tokens=600, min_tokens=600)  # over the 512-token slots
    short = SamplingConfig(temperature=0.0, max_tokens=8, min_tokens=8)
    [(long_seq, long_first)] = batched.prefill([prompt], [[]], [sampling])
    [(short_seq, short_first)] = batched.prefill([prompt], [[]], [short])
    outs = [[long_first], [short_first]]
    while len(outs[1]) < 8:
        for out, token in zip(outs, batched.step([long_seq, short_seq]), strict=True):
            out.append(token)
    assert long_seq.slot < 0 and short_seq.slot == 0
    assert outs[1] == _alone(alone, prompt, [], short)
    assert outs[0] == _alone(alone, prompt, [], SamplingConfig(temperature=0.0, max_tokens=8, min_tokens=8))
    batched.release(long_seq)
    batched.release(short_seq)


def test_kv_of_a_batched_sequence_exports_as_the_per_sequence_one(engines: Any) -> None:
    _, batched, alone = engines
    prompt = batched.tokenizer("Export me")["input_ids"]
    sampling = SamplingConfig(temperature=0.0, max_tokens=6, min_tokens=6)
    [(a, _)] = batched.prefill([prompt], [[]], [sampling])
    [(b, _)] = alone.prefill([prompt], [[]], [sampling])
    for _ in range(3):
        batched.step([a])
        alone.step([b])
    got, state = batched.export_kv(a)
    want, want_state = alone.export_kv(b)
    assert state == want_state
    assert all(g.shape == w.shape and (g - w).abs().max() < 1e-5 for g, w in zip(got, want, strict=True))
    batched.release(a)
    alone.release(b)


def test_a_cache_written_into_its_reserved_slot_decodes_as_the_sequence_it_left(engines: Any) -> None:
    """reserve_kv: the slot's views take the cache in place (what a NIXL READ
    does); rows around it keep decoding meanwhile, a slot freed below it
    becomes a hole the next sequence takes, and a slot a READ may still
    write is never handed out again."""
    name, batched, alone = engines
    prompts = _prompts(batched, name)
    greedy = SamplingConfig(temperature=0.0, max_tokens=N, min_tokens=N)
    # What the prefill worker hands over: its sequence after prefill and two steps.
    (p_a, m_a), (p_b, _), (p_c, _) = prompts[1], prompts[0], prompts[2]
    [(sent, first)] = alone.prefill([p_a], [m_a], [greedy])
    head = [first, *alone.step([sent]), *alone.step([sent])]
    tensors, state = alone.export_kv(sent)
    alone.release(sent)

    [(b, b_first)] = batched.prefill([p_b], [[]], [greedy])
    b_out = [b_first, *batched.step([b])]
    reserved = batched.reserve_kv(state, greedy)
    assert reserved is not None
    a, targets = reserved
    assert a.slot == 1 and a.receiving
    assert [tuple(t.shape) for t in targets] == [batched.kv_shape(state)] * len(tensors)
    with pytest.raises(ValueError, match="still arriving"):
        batched.step([a])
    b_out += batched.step([b])  # the receiving row steps too, unread
    for target, tensor in zip(targets, tensors, strict=True):
        target.copy_(tensor)
    batched.received(a)
    a_out = list(head)
    while len(a_out) < N:
        token_a, token_b = batched.step([a, b])
        a_out.append(token_a)
        b_out.append(token_b)
    assert a_out == _alone(alone, p_a, m_a, greedy)
    assert b_out == _alone(alone, p_b, [], greedy)

    # b (slot 0) leaves while a new reservation sits on top: slot 0 becomes a hole, c takes it.
    batched.release(a)
    again = batched.reserve_kv(state, greedy)
    assert again is not None and again[0].slot == 1
    batched.release(b)
    assert batched._slots is not None and batched._slots.rows[0] is None
    [(c, c_first)] = batched.prefill([p_c], [[]], [greedy])
    c_out = [c_first]
    while len(c_out) < N:
        c_out += batched.step([c])
    assert c.slot == 0 and c_out == _alone(alone, p_c, [], greedy)
    batched.release(c)
    # A READ that could not be cancelled: its slot stays out of use for good.
    batched.abandon(again[0], True)
    assert batched._slots.rows == [None, again[0]] and batched._slots.taken == 1
    batched._slots.rows.clear()  # the module-scoped engine goes on to other tests
