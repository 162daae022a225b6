"""The decode loop over a KV pool far smaller than what is asked of it
(stages/torch_engine/slots.py, scheduler.py): sequences of different
lengths join, wait for blocks, grow, are swapped out and back, and some
leave mid-stream, while steps are launched one ahead; every stream is the
sequence decoded alone, and the pool and rows come back whole. And blocks
given back without a word to the loop still let a waiting sequence go."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from stages.models import builtin_path
from stages.sampling import SamplingConfig
from stages.torch_engine import metrics
from stages.torch_engine.engine import TorchEngine
from stages.torch_engine.scheduler import DecodeScheduler, EngineThread
from stages.torch_engine.sequence import KvState
from stages.torch_engine.settings import DecodeSettings
from tests.polling import eventually
from tests.stages.engine_helpers import engine_on

MAX_LEN = 128


async def test_the_decode_loop_over_a_small_pool_loses_nothing_under_churn(
    mmpipe_home: Path, engine_device: str
) -> None:
    model_dir = builtin_path("tiny-qwen2-vl")
    probe = engine_on(engine_device, model_dir, DecodeSettings(slots=8, max_len=MAX_LEN))
    assert probe.decoder is not None
    # 12 blocks of 16 tokens (and the null block) for twelve sequences of up to 80 positions.
    memory = 13 * probe.decoder.bytes_per_block
    engine = engine_on(engine_device, model_dir, DecodeSettings(slots=8, max_len=MAX_LEN, kv_cache_memory=str(memory)))
    alone = engine_on(engine_device, model_dir, DecodeSettings(batched=False))
    decoder = engine.decoder
    assert decoder is not None and decoder.pool.capacity == 12
    prompts = [engine.tokenizer(f"Count {i}: " + "x " * (2 * i))["input_ids"] for i in range(12)]
    samplings = [SamplingConfig(temperature=0.0, max_tokens=20 + 4 * i, min_tokens=20 + 4 * i) for i in range(12)]
    expected = [_alone(alone, p, s) for p, s in zip(prompts, samplings, strict=True)]
    # Three leave early: their consumer stops after this many tokens.
    leave_after = {2: 5, 7: 12, 10: 3}
    thread = EngineThread()
    scheduler = DecodeScheduler(engine, thread, max_batch=8)
    scheduler.start()
    preempted = metrics.PREEMPTIONS._value.get()

    async def consume(i: int) -> list[int]:
        [(seq, first)] = await thread.call(engine.prefill, [prompts[i]], [[]], [samplings[i]])
        tokens = [first]
        want = samplings[i].max_tokens
        stream = scheduler.stream(seq, lambda _: len(tokens) + 1 >= want)
        async with contextlib.aclosing(stream) as tokens_in:
            async for token in tokens_in:
                tokens.append(token)
                if len(tokens) == leave_after.get(i):
                    break
        return tokens

    try:
        got = await asyncio.wait_for(asyncio.gather(*(consume(i) for i in range(12))), timeout=300)
    finally:
        await scheduler.close()
    # What the loop gave back is released on the engine's thread, in order: once this runs, all of it has.
    await thread.call(lambda: None)
    thread.close()
    for i, tokens in enumerate(got):
        assert tokens == expected[i][: leave_after.get(i, len(expected[i]))], i
    assert metrics.PREEMPTIONS._value.get() > preempted
    assert engine._slots is not None and not engine._slots.rows and engine._slots.promised == 0
    assert decoder.pool.num_free == decoder.pool.capacity


def _alone(engine: TorchEngine, prompt: list[int], sampling: SamplingConfig) -> list[int]:
    [(seq, first)] = engine.prefill([prompt], [[]], [sampling])
    out = [first]
    while len(out) < sampling.max_tokens:
        out += [t for t in engine.step([seq]) if t is not None]
    engine.release(seq)
    return out


async def test_a_sequence_waiting_for_blocks_goes_once_a_transfer_gives_them_back(
    mmpipe_home: Path, engine_device: str
) -> None:
    """Blocks held for a KV transfer that is then given up come back with
    no word to the decode loop: a sequence waiting for them goes anyway."""
    model_dir = builtin_path("tiny-qwen2-vl")
    probe = engine_on(engine_device, model_dir, DecodeSettings(slots=4, max_len=MAX_LEN))
    assert probe.decoder is not None
    engine = engine_on(
        engine_device,
        model_dir,
        DecodeSettings(slots=4, max_len=MAX_LEN, kv_cache_memory=str(9 * probe.decoder.bytes_per_block)),
    )
    greedy = SamplingConfig(temperature=0.0, max_tokens=8, min_tokens=8)
    prompt = engine.tokenizer("Wait for me")["input_ids"]
    expected = _alone(engine_on(engine_device, model_dir, DecodeSettings(batched=False)), prompt, greedy)
    # Another worker's cache of 100 positions on its way: 7 of the 8 blocks.
    held = engine.reserve_kv(KvState(prompt_len=100, output_ids=[1], rope_delta=0), greedy)
    assert held is not None and engine.decoder is not None and engine.decoder.pool.num_free == 1
    thread = EngineThread()
    scheduler = DecodeScheduler(engine, thread, max_batch=4)
    scheduler.start()
    try:
        [(seq, first)] = await thread.call(engine.prefill, [prompt], [[]], [greedy])
        tokens = [first]

        async def consume() -> None:
            async for token in scheduler.stream(seq, lambda _: len(tokens) + 1 >= 8):
                tokens.append(token)

        consumer = asyncio.ensure_future(consume())
        await eventually(lambda: scheduler.blocked, within=10)
        await asyncio.sleep(0.2)
        assert tokens == [first]  # no blocks, no step
        await thread.call(engine.abandon, held[0], False)
        await asyncio.wait_for(consumer, 30)
    finally:
        await scheduler.close()
        thread.close()
    assert tokens == expected


async def test_a_prompt_holding_cached_blocks_goes_ahead_of_a_swapped_out_sequence_short_of_them(
    mmpipe_home: Path, engine_device: str
) -> None:
    """A prompt that found a cached prefix holds those blocks while it waits
    for the rest; the running sequence fills what is left of the pool, is
    swapped out and, first in line, could come back only into blocks the
    waiting prompt holds. The prompt goes first (it used to wait behind it
    and both waited for ever: one worker under `--kv-cache-memory` for one
    conversation at a time stalled for minutes), and the swapped one comes
    back once it can grow (not into exactly the blocks it left, to be
    swapped out again at once); both streams are the sequences decoded alone."""
    engine, words = _pool_of_one_sequence(engine_device)
    decoder = engine.decoder
    assert decoder is not None
    shared = words[:160]  # ten full blocks
    earlier, first, second = shared + words[160:170], words[170:230], shared + words[230:520]
    short = SamplingConfig(temperature=0.0, max_tokens=8, min_tokens=8)
    long = SamplingConfig(temperature=0.0, max_tokens=400, min_tokens=400)
    alone = engine_on(engine_device, builtin_path("tiny-qwen2-vl"), DecodeSettings(batched=False))
    expected = [_alone(alone, first, long), _alone(alone, second, short)]
    _alone(engine, earlier, short)  # its prompt's full blocks stay cached
    thread = EngineThread()
    scheduler = DecodeScheduler(engine, thread, max_batch=4)
    scheduler.start()
    preempted = metrics.PREEMPTIONS._value.get()
    got: list[list[int]] = [[], []]

    async def consume(i: int, seq: object, first_token: int, want: int) -> None:
        got[i] = [first_token]
        async for token in scheduler.stream(seq, lambda _: len(got[i]) + 1 >= want):
            got[i].append(token)

    try:
        [(running, token)] = await thread.call(engine.prefill, [first], [[]], [long])
        one = asyncio.ensure_future(consume(0, running, token, long.max_tokens))
        await eventually(lambda: len(got[0]) > 2, within=30)
        [(waiting, token)] = await thread.call(engine.prefill, [second], [[]], [short])
        assert len(waiting.blocks) == 10 and waiting.slot < 0  # the cached prefix; no room for the rest yet
        two = asyncio.ensure_future(consume(1, waiting, token, short.max_tokens))
        await asyncio.wait_for(asyncio.gather(one, two), timeout=120)
    finally:
        await scheduler.close()
    await thread.call(lambda: None)
    thread.close()
    assert got == expected
    assert metrics.PREEMPTIONS._value.get() > preempted
    assert decoder.pool.num_free == decoder.pool.capacity


async def test_prompts_each_holding_a_cached_prefix_and_short_of_the_rest_let_go_until_one_fits(
    mmpipe_home: Path, engine_device: str
) -> None:
    """Two prompts, each holding the cached prefix it found, each short of
    blocks for the rest by what the other holds, nothing running: the last
    in line lets its prefix's blocks go (its own cache holds them too), the
    first runs, then the other; both streams are the prompts decoded alone
    (they used to wait for ever: one worker, a pool for about one
    conversation, four users)."""
    engine, words = _pool_of_one_sequence(engine_device)
    decoder = engine.decoder
    assert decoder is not None
    a, b, rest = words[:192], words[192:384], words[384:]  # twelve blocks each
    short = SamplingConfig(temperature=0.0, max_tokens=8, min_tokens=8)
    prompts = [a + rest[:120], b + rest[120:240]]  # twenty blocks each
    alone = engine_on(engine_device, builtin_path("tiny-qwen2-vl"), DecodeSettings(batched=False))
    expected = [_alone(alone, p, short) for p in prompts]
    for earlier in (a + rest[:4], b + rest[:4]):
        _alone(engine, earlier, short)  # their prompts' full blocks stay cached
    thread = EngineThread()
    scheduler = DecodeScheduler(engine, thread, max_batch=4)
    scheduler.start()
    got: list[list[int]] = [[], []]

    async def consume(i: int, seq: object, first_token: int) -> None:
        got[i] = [first_token]
        async for token in scheduler.stream(seq, lambda _: len(got[i]) + 1 >= short.max_tokens):
            got[i].append(token)

    try:
        pairs = await thread.call(engine.prefill, prompts, [[], []], [short, short])
        assert [len(seq.blocks) for seq, _ in pairs] == [12, 12]
        # Each needs eight more (and the spare block) of the eight left free.
        assert not any(engine.admissible([seq for seq, _ in pairs]))
        await asyncio.wait_for(
            asyncio.gather(*(consume(i, seq, token) for i, (seq, token) in enumerate(pairs))), timeout=120
        )
    finally:
        await scheduler.close()
    await thread.call(lambda: None)
    thread.close()
    assert got == expected
    assert decoder.pool.num_free == decoder.pool.capacity


def _pool_of_one_sequence(engine_device: str) -> tuple[TorchEngine, list[int]]:
    """An engine whose pool holds one sequence of 512 tokens (32 blocks of
    16) and no more, and 300 words' token ids to make prompts of."""
    model_dir = builtin_path("tiny-qwen2-vl")
    probe = engine_on(engine_device, model_dir, DecodeSettings(slots=4, max_len=512))
    assert probe.decoder is not None
    memory = str(33 * probe.decoder.bytes_per_block)
    engine = engine_on(engine_device, model_dir, DecodeSettings(slots=4, max_len=512, kv_cache_memory=memory))
    assert engine.decoder is not None and engine.decoder.pool.capacity == 32
    return engine, list(engine.tokenizer(" ".join(f"w{i}" for i in range(300)))["input_ids"])
