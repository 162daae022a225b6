"""The batch decoder: sequences that join and leave between steps, of
different lengths, with and without images, give exactly the tokens of the
per-sequence path (itself equal to generate()); their caches in blocks of
one pool, which come back when they leave; what does not fit falls back to
that path. On --engine-device cuda the decoder replays CUDA graphs and its
fused step is compiled."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from stages.models import builtin_path
from stages.sampling import SamplingConfig
from stages.torch_engine.batch_decoder import Launched, from_blocks
from stages.torch_engine.engine import TorchEngine
from stages.torch_engine.reference import load_reference_model, reference_generate
from stages.torch_engine.settings import DecodeSettings
from tests.stages.engine_helpers import chat_prompt, engine_on

N = 16


@pytest.fixture(
    scope="module",
    params=[(m, fused) for m in ("tiny-qwen2-vl", "tiny-llava", "tiny-qwen2-audio") for fused in ("modules", "fused")],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def engines(
    request: pytest.FixtureRequest, mmpipe_home: Path, engine_device: str
) -> tuple[str, TorchEngine, TorchEngine]:
    """A batch decoder on the model's modules (the CPU default), or on the
    fused layer step (the GPU default; eager on the CPU, compiled on CUDA),
    in CUDA graphs on CUDA, and an engine without one (each sequence on
    its own)."""
    name, step = request.param
    model_dir = builtin_path(name)
    fused = step != "modules"
    batched = engine_on(engine_device, model_dir, DecodeSettings(slots=4, max_len=512, fused=fused))
    assert batched.decoder is not None and (batched.decoder.fused is not None) == fused
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
        # One joins per step; more than the 4 rows wait for one (no token that step).
        if pending:
            i = pending.pop(0)
            (prompt, media), sampling = prompts[i], samplings[i]
            [(seq, first)] = batched.prefill([prompt], [media], [sampling])
            outputs[i], running[i] = [first], seq
        tokens = batched.step(list(running.values()))
        assert batched._slots is not None and batched._slots.taken == min(len(running), 4)
        assert tokens.count(None) == len(running) - batched._slots.taken
        for (i, seq), token in zip(list(running.items()), tokens, strict=True):
            if token is None:
                continue
            outputs[i].append(token)
            if len(outputs[i]) == samplings[i].max_tokens:
                batched.release(seq)
                del running[i]
    assert [outputs[i] for i in range(len(prompts))] == expected
    assert batched._slots is not None and len(batched._slots) == 0
    assert batched.decoder is not None and batched.decoder.pool.num_free == batched.decoder.pool.capacity


def test_steps_launched_one_ahead_give_the_tokens_of_one_at_a_time(engines: Any) -> None:
    """The decode loop's way (stages.torch_engine.scheduler): step k+1 is
    launched before step k's tokens are read, so every token after the first
    launch comes from the device; a sequence that ends takes one step more
    (dropped), and is freed while that step is launched: the last row moves
    into its place (its block table; the launched step wrote through the old). EOS is masked on the
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


def test_a_prefill_token_on_its_way_leaves_its_cache_alone_while_others_step(engines: Any) -> None:
    """On a GPU a hop's prefill leaves its token on the device on its way to
    the host (``prefill(defer=True)``) while the decode loop goes on stepping
    the other rows: the waiting row (the fused engines prefill straight into
    a row) takes part in those steps' forward, and must not write over its
    prompt's last position (nor read a token it has not got). The CPU makes
    the same state by hand."""
    name, batched, alone = engines
    prompts = _prompts(batched, name)
    sampling = SamplingConfig(temperature=0.0, max_tokens=8, min_tokens=8)
    (first_prompt, first_media), (later_prompt, later_media) = prompts[0], prompts[1]
    [(running, token)] = batched.prefill([first_prompt], [first_media], [sampling])
    outputs = [[token], []]
    [(waiting, deferred)] = batched.prefill([later_prompt], [later_media], [sampling], defer=True)
    if waiting.pending is None:
        assert deferred == waiting.output_ids.pop()
        waiting.pending = Launched(torch.tensor([deferred], device=batched.device), 1)
    assert waiting.output_ids == []
    # The fused engines prefill straight into the decoder's blocks: the waiting row is there.
    assert (waiting.slot >= 0) == (batched._slot_prefill is not None)
    for _ in range(3):
        [token] = batched.step([running])
        outputs[0].append(token)
    outputs[1].append(batched.settle(waiting))
    while len(outputs[1]) < sampling.max_tokens:
        for out, token in zip(outputs, batched.step([running, waiting]), strict=True):
            if len(out) < sampling.max_tokens:
                out.append(token)
    assert outputs == [
        _alone(alone, first_prompt, first_media, sampling),
        _alone(alone, later_prompt, later_media, sampling),
    ]
    batched.release(running)
    batched.release(waiting)


def _batched(
    batched: TorchEngine,
    prompts: list[Any],
    samplings: list[SamplingConfig],
    ahead: bool,
    loras: list[str | None] | None = None,
) -> tuple[dict[int, list[int]], dict[int, Any]]:
    """Each prompt's tokens, all in the batched step together (launched one
    ahead, or stepped), and its sequence (``loras``: each one's adapter)."""
    outputs: dict[int, list[int]] = {}
    running: dict[int, Any] = {}
    seqs: dict[int, Any] = {}
    launched: tuple[Any, list[tuple[int, Any]]] | None = None
    for i, ((prompt, media), sampling) in enumerate(zip(prompts, samplings, strict=True)):
        lora = [loras[i]] if loras is not None else None
        [(seq, token)] = batched.prefill([prompt], [media], [sampling], loras=lora)
        outputs[i], running[i], seqs[i] = [token], seq, seq
    while running or launched:
        batch = list(running.items())
        if not ahead:
            for (i, seq), token in zip(batch, batched.step([seq for _, seq in batch]), strict=True):
                outputs[i].append(token)
                if len(outputs[i]) == samplings[i].max_tokens:
                    batched.release(seq)
                    del running[i]
            continue
        launch = batched.launch([seq for _, seq in batch]) if batch else None
        assert launch is not None or not batch  # every row goes in the step
        if launched is not None:
            was_launch, was = launched
            for (i, seq), token in zip(was, batched.collect(was_launch), strict=True):
                if i not in running:
                    continue
                outputs[i].append(token)
                if len(outputs[i]) == samplings[i].max_tokens:
                    batched.release(seq)
                    del running[i]
        launched = (launch, batch) if launch is not None else None
    return outputs, seqs


def _assert_batched_is_alone(
    batched: TorchEngine, alone: TorchEngine, prompts: list[Any], samplings: list[SamplingConfig], ahead: bool
) -> None:
    """The batched step gives each row the tokens and logprobs of the host's choice, one sequence at a time."""
    expected = [_logprobs_alone(alone, p, m, s) for (p, m), s in zip(prompts, samplings, strict=True)]
    outputs, seqs = _batched(batched, prompts, samplings, ahead)
    for i, (tokens, logprobs) in enumerate(expected):
        assert outputs[i] == tokens, i
        if logprobs is not None:
            got = [seqs[i].logprobs[k] for k in range(len(tokens))]
            assert [lp.logprob for lp in got] == pytest.approx([lp.logprob for lp in logprobs], abs=1e-4)
            assert [[t for t, _ in lp.top] for lp in got] == [[t for t, _ in lp.top] for lp in logprobs]


def _logprobs_alone(engine: TorchEngine, prompt: list[int], media: list[Any], sampling: SamplingConfig) -> Any:
    [(seq, first)] = engine.prefill([prompt], [media], [sampling])
    out = [first]
    while len(out) < sampling.max_tokens:
        out += engine.step([seq])
    engine.release(seq)
    return out, [seq.logprobs[i] for i in range(len(out))] if sampling.logprobs is not None else None


@pytest.mark.parametrize("ahead", [True, False], ids=["launched", "stepped"])
def test_penalties_bias_and_logprobs_in_the_step_are_the_hosts(engines: Any, ahead: bool) -> None:
    """Greedy rows with OpenAI's penalties, vLLM's repetition penalty, a
    logit bias and logprobs are chosen in the batched step (launched one
    ahead, or stepped), beside a plain row, each row its own, the generated
    tokens counted on the device: the tokens and logprobs of the host's
    choice, one sequence at a time."""
    name, batched, alone = engines
    prompts = _prompts(batched, name)[:4]
    first = prompts[0][0]
    samplings = [
        SamplingConfig(max_tokens=N, min_tokens=N, presence_penalty=2.0, frequency_penalty=2.0, logprobs=2),
        SamplingConfig(max_tokens=N - 4, min_tokens=N - 4),
        SamplingConfig(
            max_tokens=N, min_tokens=N, repetition_penalty=1.7, prompt_ids=tuple(sorted(set(prompts[2][0])))
        ),
        SamplingConfig(max_tokens=N - 2, min_tokens=3, logit_bias=((first[0], 4.0), (7, -100.0)), logprobs=0),
    ]
    _assert_batched_is_alone(batched, alone, prompts, samplings, ahead)
    # The penalties change the answer (the repetition penalty's row, only where the model repeats).
    assert _alone(alone, *prompts[0], samplings[0]) != _alone(
        alone, *prompts[0], SamplingConfig(max_tokens=N, min_tokens=N)
    )


@pytest.mark.parametrize("ahead", [True, False], ids=["launched", "stepped"])
def test_sampling_in_the_step_is_the_hosts(engines: Any, ahead: bool) -> None:
    """Rows that sample (temperature, top-k, top-p, min-p, a seed each) draw
    in the batched step, beside a greedy row, with penalties and logprobs on
    some: each row the tokens and logprobs of the host's draw for it alone
    (the draw depends on the row's seed and the token's index only)."""
    name, batched, alone = engines
    prompts = _prompts(batched, name)[:4]
    samplings = [
        SamplingConfig(temperature=1.0, seed=1, max_tokens=N, min_tokens=N, logprobs=3),
        SamplingConfig(temperature=0.8, top_k=20, seed=2, max_tokens=N - 4, min_tokens=2),
        SamplingConfig(max_tokens=N - 2, min_tokens=N - 2),
        SamplingConfig(
            temperature=1.5, top_p=0.6, min_p=0.05, top_k=50, seed=4, max_tokens=N, min_tokens=N, presence_penalty=1.0
        ),
    ]
    _assert_batched_is_alone(batched, alone, prompts, samplings, ahead)
    # The draws matter: another seed, another answer.
    first = _alone(alone, *prompts[0], samplings[0])
    assert first != _alone(alone, *prompts[0], dataclasses.replace(samplings[0], seed=5))


def test_what_cannot_launch_steps_instead(engines: Any) -> None:
    _, batched, _ = engines
    prompt = batched.tokenizer("Sample me")["input_ids"]
    [(greedy, _)] = batched.prefill([prompt], [[]], [SamplingConfig(max_tokens=4)])
    # Stop ids masked below min_tokens: the step masks the model's EOS only.
    stops = SamplingConfig(temperature=0.8, max_tokens=4, min_tokens=2, stop_token_ids=(7,))
    [(sampled, _)] = batched.prefill([prompt], [[]], [stops])
    too_long = SamplingConfig(max_tokens=600)  # over the 512 tokens a sequence may hold
    [(outside, _)] = batched.prefill([prompt], [[]], [too_long])
    assert batched.launch([greedy, sampled]) is None  # chosen on the host
    assert batched.launch([outside]) is None and outside.slot < 0
    launch = batched.launch([greedy])
    assert launch is not None and greedy.inflight == 1
    with pytest.raises(ValueError, match="not collected"):
        batched.step([greedy])
    [token] = batched.collect(launch)
    assert greedy.inflight == 0 and greedy.output_ids[-1] == token
    for seq in (greedy, sampled, outside):
        batched.release(seq)


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-llava"])
def test_a_step_of_many_rows_gives_each_rows_tokens(mmpipe_home: Path, engine_device: str, name: str) -> None:
    """Twenty greedy rows in one step (a bucket of 32: on CPU the head is a
    vocabulary-major product there, its argmax read by columns) give each
    row's tokens of one at a time."""
    model_dir = builtin_path(name)
    batched = engine_on(engine_device, model_dir, DecodeSettings(slots=24, max_len=512))
    alone = engine_on(engine_device, model_dir, DecodeSettings(batched=False))
    prompts = (_prompts(batched, name) * 4)[:20]
    samplings = [SamplingConfig(temperature=0.0, max_tokens=12 - i % 5, min_tokens=12 - i % 5) for i in range(20)]
    expected = [_alone(alone, p, m, s) for (p, m), s in zip(prompts, samplings, strict=True)]
    started = [batched.prefill([p], [m], [s])[0] for (p, m), s in zip(prompts, samplings, strict=True)]
    outputs = [[first] for _, first in started]
    running = {i: seq for i, (seq, _) in enumerate(started)}
    while running:
        tokens = batched.step(list(running.values()))
        for (i, seq), token in zip(list(running.items()), tokens, strict=True):
            assert token is not None
            outputs[i].append(token)
            if len(outputs[i]) == samplings[i].max_tokens:
                batched.release(seq)
                del running[i]
    assert outputs == expected


def test_batched_decode_equals_generate(engines: Any, engine_device: str) -> None:
    name, batched, _ = engines
    model_dir = builtin_path(name)
    prompt, _ = _prompts(batched, name)[3]
    reference = load_reference_model(model_dir, device=engine_device)
    expected = reference_generate(model_dir, prompt, [], N, model=reference)
    assert _alone(batched, prompt, [], SamplingConfig(temperature=0.0, max_tokens=N, min_tokens=N)) == expected


def test_a_sequence_too_long_for_the_decoder_decodes_on_its_own(engines: Any) -> None:
    _, batched, alone = engines
    prompt = batched.tokenizer("A long answer, please.")["input_ids"]
    sampling = SamplingConfig(temperature=0.0, max_tokens=600, min_tokens=600)  # over the 512 a sequence may hold
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
    # In blocks; what lies past the cache in its last block is nobody's to read.
    length = state.prompt_len + len(state.output_ids) - 1
    assert all(
        g.shape == w.shape and (from_blocks(g, length) - from_blocks(w, length)).abs().max() < 1e-5
        for g, w in zip(got, want, strict=True)
    )
    batched.release(a)
    alone.release(b)


def test_a_cache_written_into_its_reserved_blocks_decodes_as_the_sequence_it_left(engines: Any) -> None:
    """reserve_kv: views of the blocks take the cache in place (what a NIXL
    READ does, block by block); the sequence holds blocks and the promise of
    a row, but no row and no step, until it is received; rows around it
    keep decoding meanwhile. Blocks a READ may still write are never handed
    out again; every other block comes back."""
    name, batched, alone = engines
    pool = batched.decoder.pool
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
    assert a.slot < 0 and a.receiving and a.blocks and batched._slots.taken == 2
    shape = batched.kv_shape(state)
    assert len(targets) == len(tensors) and all(len(pieces) == shape[0] for pieces in targets)
    assert all(tuple(piece.shape) == shape[1:] for pieces in targets for piece in pieces)
    with pytest.raises(ValueError, match="still arriving"):
        batched.step([a])
    b_out += batched.step([b])
    for pieces, tensor in zip(targets, tensors, strict=True):
        for piece, block in zip(pieces, tensor, strict=True):
            piece.copy_(block)
    batched.received(a)
    assert a.slot == 1
    a_out = list(head)
    while len(a_out) < N:
        token_a, token_b = batched.step([a, b])
        a_out.append(token_a)
        b_out.append(token_b)
    assert a_out == _alone(alone, p_a, m_a, greedy)
    assert b_out == _alone(alone, p_b, [], greedy)

    # b (row 0) leaves: a moves down to row 0 and goes on as it was.
    batched.release(b)
    assert a.slot == 0 and batched._slots.rows == [a]
    batched.release(a)
    assert pool.num_free == pool.capacity
    # A reservation never received frees its blocks; one a READ may still write does not.
    again = batched.reserve_kv(state, greedy)
    assert again is not None
    batched.abandon(again[0], False)
    assert pool.num_free == pool.capacity and batched._slots.taken == 0
    tainted = batched.reserve_kv(state, greedy)
    assert tainted is not None
    leaked = list(tainted[0].blocks)
    batched.abandon(tainted[0], True)
    assert pool.num_free == pool.capacity - len(leaked) and batched._slots.taken == 0
    assert not set(leaked) & set(pool._free)
    [(c, c_first)] = batched.prefill([p_c], [[]], [greedy])
    c_out = [c_first]
    while len(c_out) < N:
        c_out += batched.step([c])
    assert c.slot == 0 and not set(c.blocks) & set(leaked) and c_out == _alone(alone, p_c, [], greedy)
    batched.release(c)
    pool.free(leaked)  # the module-scoped engine goes on to other tests


def test_a_pool_too_small_for_all_swaps_the_youngest_out_and_back(mmpipe_home: Path, engine_device: str) -> None:
    """--kv-cache-memory in bytes: that many bytes of blocks, one sequence of
    --decode-max-len at least (128 tokens, 8 blocks). Four sequences
    join with a block each and grow past what the pool holds: the youngest
    is swapped out (no token that step) while the older grow, and comes back
    where it was once blocks are free; every sequence's tokens are those of
    one decoded alone, none twice. One that the pool could never hold to its
    end (past --decode-max-len) steps on its own cache."""
    model_dir = builtin_path("tiny-qwen2-vl")
    probe = engine_on(engine_device, model_dir, DecodeSettings(slots=4, max_len=128))
    assert probe.decoder is not None
    per_block = probe.decoder.bytes_per_block
    with pytest.raises(ValueError, match="fewer than one sequence of --decode-max-len 128"):
        engine_on(engine_device, model_dir, DecodeSettings(slots=4, max_len=128, kv_cache_memory=str(8 * per_block)))
    engine = engine_on(
        engine_device, model_dir, DecodeSettings(slots=4, max_len=128, kv_cache_memory=str(9 * per_block + 5))
    )
    decoder = engine.decoder
    assert decoder is not None and decoder.pool.num_blocks == 9 and decoder.nbytes == 9 * per_block
    alone = engine_on(engine_device, model_dir, DecodeSettings(batched=False))
    prompts = [engine.tokenizer(text)["input_ids"] for text in ("One", "Two, two", "Three three three", "Four")]
    greedy = SamplingConfig(temperature=0.0, max_tokens=40, min_tokens=40)  # 3 blocks each, 12 in all
    expected = [_alone(alone, p, [], greedy) for p in prompts]
    outs, running, skipped = [], [], 0
    for prompt in prompts:
        [(seq, first)] = engine.prefill([prompt], [[]], [greedy])
        outs.append([first])
        running.append(seq)
    swapped_seen = False
    while any(len(out) < 40 for out in outs):
        live = [(out, seq) for out, seq in zip(outs, running, strict=True) if len(out) < 40]
        for (out, seq), token in zip(live, engine.step([seq for _, seq in live]), strict=True):
            swapped_seen = swapped_seen or seq.swapped is not None
            if token is None:
                skipped += 1
                continue
            out.append(token)
            if len(out) == 40:
                engine.release(seq)
        assert decoder.pool.num_free >= 0 and len(engine._slots or []) <= 4
    assert outs == expected
    assert skipped and swapped_seen  # someone waited in host memory
    assert decoder.pool.num_free == decoder.pool.capacity
    wide = SamplingConfig(temperature=0.0, max_tokens=200, min_tokens=200)  # past --decode-max-len
    [(seq, _)] = engine.prefill([prompts[0]], [[]], [wide])
    assert engine.step([seq]) != [None] and seq.slot < 0 and seq.cache is not None
    engine.release(seq)


def test_choices_fork_from_one_prefill(engines: Any) -> None:
    """The choices of a prompt fork from the first one's prefill (``fork``):
    its prompt's keys and values copied from its cache, or from its blocks
    once it has stepped (kept forkable), its prefill's logits sampled by each
    choice's own config: the tokens of a prefill of their own."""
    name, batched, alone = engines
    prompt, media = _prompts(batched, name)[1]  # with an image where the family takes one
    first = SamplingConfig(max_tokens=N, min_tokens=N)
    choices = [
        SamplingConfig(temperature=0.9, seed=3, max_tokens=N, min_tokens=N),
        SamplingConfig(temperature=0.9, seed=4, max_tokens=N - 3, min_tokens=N - 3, logprobs=2),
    ]
    [(source, token)] = batched.prefill([prompt], [media], [first])
    source.forkable = True
    forked = batched.fork(source, choices[0])  # from its cache: the decoder has not taken it yet
    assert forked is not None and forked[0].cached_tokens == source.cached_tokens
    outputs = {"source": [token]}
    running = {"source": source}
    outputs["one"], running["one"] = [forked[1]], forked[0]
    for out, new in zip(outputs.values(), batched.step(list(running.values())), strict=True):
        out.append(new)
    assert source.cache is None and source.slot >= 0  # in the decoder's blocks now
    later = batched.fork(source, choices[1])
    assert later is not None
    outputs["two"], running["two"] = [later[1]], later[0]
    while running:
        batch = list(running.items())
        for (key, seq), new in zip(batch, batched.step([seq for _, seq in batch]), strict=True):
            outputs[key].append(new)
            if len(outputs[key]) == seq.sampling.max_tokens:
                batched.release(seq)
                del running[key]
    assert outputs["source"] == _alone(alone, prompt, media, first)
    assert outputs["one"] == _alone(alone, prompt, media, choices[0])
    tokens, logprobs = _logprobs_alone(alone, prompt, media, choices[1])
    assert outputs["two"] == tokens
    assert [lp.logprob for lp in later[0].logprobs.values()] == pytest.approx([lp.logprob for lp in logprobs], abs=1e-4)
    # Released, or stepped past its prefill without being kept forkable: no fork.
    assert batched.fork(source, choices[0]) is None
    [(plain, _)] = batched.prefill([prompt], [media], [first])
    batched.step([plain])
    assert plain.prompt_logits is None and batched.fork(plain, choices[0]) is None
    batched.release(plain)
