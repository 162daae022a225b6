"""Prefix caching in the built-in engine (--enable-prefix-caching): a
prompt that starts as an earlier one reuses that one's KV blocks from the
pool and prefills only the rest, and still gives generate()'s greedy
tokens; blocks showing media are shared only when the media's bytes are
equal; cached blocks that no one holds are taken back once the pool needs
them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from stages.families import MediaEmbedding
from stages.torch_engine.engine import TorchEngine
from stages.torch_engine.reference import reference_generate
from stages.torch_engine.settings import DecodeSettings
from tests.e2e.conftest import gradient
from tests.stages.engine_helpers import chat_prompt, decode, engine_on, greedy

N = 6
BLOCK = 16


def _run(engine: TorchEngine, prompt: list[int], media: list[MediaEmbedding]) -> tuple[list[int], int]:
    """A prompt's N greedy tokens and how many of its tokens came from the cache; its blocks freed."""
    [(seq, first)] = engine.prefill([prompt], [media], [greedy(N)])
    tokens = decode(engine, seq, first, N)
    engine.release(seq)
    return tokens, seq.cached_tokens


def _hits() -> tuple[float, float]:
    return (
        REGISTRY.get_sample_value("mmpipe_prefix_cache_queries_total") or 0.0,
        REGISTRY.get_sample_value("mmpipe_prefix_cache_hits_total") or 0.0,
    )


def test_a_prompt_that_starts_as_an_earlier_one_prefills_only_the_rest_with_generates_tokens(
    tiny_model_dir: Path, engine_device: str
) -> None:
    engine = engine_on(engine_device, tiny_model_dir, DecodeSettings(slots=4, max_len=512))
    first = chat_prompt(engine, [{"type": "text", "text": "Tell me about the sea " * 12}])
    longer = first + engine.tokenizer(" and the mountains too", add_special_tokens=False)["input_ids"]
    assert len(first) > 4 * BLOCK
    queries, hits = _hits()
    tokens, cached = _run(engine, first, [])
    assert cached == 0 and tokens == reference_generate(tiny_model_dir, first, [], N)
    tokens, cached = _run(engine, longer, [])
    # Every full block of the first prompt: the longer one starts with all of them.
    assert cached == len(first) // BLOCK * BLOCK
    assert tokens == reference_generate(tiny_model_dir, longer, [], N)
    # The same prompt again: all but its last block's worth, so its last token is prefilled.
    tokens, cached = _run(engine, longer, [])
    assert cached == (len(longer) - 1) // BLOCK * BLOCK
    assert tokens == reference_generate(tiny_model_dir, longer, [], N)
    after_queries, after_hits = _hits()
    assert after_queries - queries == len(first) + 2 * len(longer)
    assert after_hits - hits == len(first) // BLOCK * BLOCK + (len(longer) - 1) // BLOCK * BLOCK


def test_a_sequence_released_before_it_ever_stepped_leaves_its_prompt_cached(
    tiny_model_dir: Path, engine_device: str
) -> None:
    """One token asked for: the sequence ends at its prefill, never joining
    the decode batch; its prompt's full blocks are cached all the same."""
    engine = engine_on(engine_device, tiny_model_dir, DecodeSettings(slots=4, max_len=512))
    prompt = chat_prompt(engine, [{"type": "text", "text": "Tell me about the long road to the sea " * 10}])
    [(seq, first)] = engine.prefill([prompt], [[]], [greedy(1)])
    assert first == reference_generate(tiny_model_dir, prompt, [], 1)[0]
    engine.release(seq)
    pool = engine.decoder.pool if engine.decoder is not None else None
    assert pool is not None
    # Freed, and cached: every block can be handed out again.
    assert pool.num_cached == len(prompt) // BLOCK and pool.num_free == pool.capacity
    tokens, cached = _run(engine, prompt, [])
    assert cached == (len(prompt) - 1) // BLOCK * BLOCK
    assert tokens == reference_generate(tiny_model_dir, prompt, [], N)


def test_blocks_showing_an_image_are_shared_only_with_a_prompt_showing_the_same_bytes(
    tiny_model_dir: Path, engine_device: str
) -> None:
    engine = engine_on(engine_device, tiny_model_dir, DecodeSettings(slots=4, max_len=512))
    # Two images of one size: the same placeholder tokens, other pixels.
    one = dataclasses.replace(engine.encode([gradient(64, 64, 1)])[0], digest="one")
    other = dataclasses.replace(engine.encode([gradient(64, 64, 2)])[0], digest="other")
    unknown = dataclasses.replace(one, digest="")
    text = "Describe this picture in great detail, please, and be careful. " * 2
    prompt = chat_prompt(engine, [{"type": "text", "text": text}, {"type": "image"}, {"type": "text", "text": text}])
    ids = engine._prepare(prompt, [one], [])[0]
    start = ids.index(engine.family.placeholder_ids[one.kind])
    assert start >= 2 * BLOCK and len(ids) - start > 2 * BLOCK
    _run(engine, prompt, [one])
    tokens, cached = _run(engine, prompt, [one])
    assert cached == (len(ids) - 1) // BLOCK * BLOCK
    assert tokens == reference_generate(tiny_model_dir, prompt, [gradient(64, 64, 1)], N)
    # Another image: only the blocks wholly before it.
    tokens, cached = _run(engine, prompt, [other])
    assert cached == start // BLOCK * BLOCK
    assert tokens == reference_generate(tiny_model_dir, prompt, [gradient(64, 64, 2)], N)
    # An image whose bytes are not known: nothing from its first block on is looked up, nor cached.
    tokens, cached = _run(engine, prompt, [unknown])
    assert cached == start // BLOCK * BLOCK
    assert tokens == reference_generate(tiny_model_dir, prompt, [gradient(64, 64, 1)], N)


def test_cached_blocks_no_one_holds_are_taken_back_when_the_pool_needs_them(
    tiny_model_dir: Path, engine_device: str
) -> None:
    probe = engine_on(engine_device, tiny_model_dir, DecodeSettings(slots=2, max_len=160))
    assert probe.decoder is not None
    # Ten blocks: one prompt of ~5 blocks and its tokens at a time.
    memory = 11 * probe.decoder.bytes_per_block
    engine = engine_on(engine_device, tiny_model_dir, DecodeSettings(slots=2, max_len=160, kv_cache_memory=str(memory)))
    assert engine.decoder is not None and engine.decoder.pool.capacity == 10
    a = chat_prompt(engine, [{"type": "text", "text": "alpha beta gamma delta " * 20}])
    b = chat_prompt(engine, [{"type": "text", "text": "one two three four five " * 16}])
    _run(engine, a, [])
    assert engine.decoder.pool.num_free == 10  # its blocks idle, cached
    _run(engine, b, [])  # takes blocks a's prefix held
    assert engine.decoder.pool.evicted > 0
    tokens, cached = _run(engine, a, [])
    assert cached < (len(a) - 1) // BLOCK * BLOCK
    assert tokens == reference_generate(tiny_model_dir, a, [], N)


@pytest.mark.parametrize("caching", [True, False])
def test_with_prefix_caching_off_nothing_is_looked_up(tiny_model_dir: Path, caching: bool) -> None:
    engine = TorchEngine(tiny_model_dir, decode=DecodeSettings(slots=2, max_len=256, prefix_caching=caching))
    prompt = chat_prompt(engine, [{"type": "text", "text": "Tell me about the sea " * 8}])
    queries, _ = _hits()
    _run(engine, prompt, [])
    _, cached = _run(engine, prompt, [])
    assert (cached > 0) is caching
    assert (_hits()[0] > queries) is caching


def test_a_sequence_with_a_cached_prefix_hands_its_whole_cache_to_another_engine(
    tiny_model_dir: Path, engine_device: str
) -> None:
    engine = engine_on(engine_device, tiny_model_dir, DecodeSettings(slots=2, max_len=256))
    other = engine_on(engine_device, tiny_model_dir, DecodeSettings(slots=2, max_len=256))
    prompt = chat_prompt(engine, [{"type": "text", "text": "Tell me about the sea " * 10}])
    _run(engine, prompt, [])
    [(seq, first)] = engine.prefill([prompt], [[]], [greedy(N)])
    assert seq.cached_tokens > 0
    tensors, state = engine.export_kv(seq)
    engine.release(seq)
    assert state.prompt_len == len(prompt) and tensors[0].shape[0] == -(-len(prompt) // BLOCK)
    moved = other.import_kv(tensors, state, greedy(N))
    assert decode(other, moved, first, N) == reference_generate(tiny_model_dir, prompt, [], N)
