"""vLLM's KV events as mmpipe's router reads them: the worker that gave
vLLM a prompt rewrites vLLM's block hashes as mmpipe's keys of the same
blocks, so the router finds a prompt's prefix on a vLLM worker as it does
on a built-in one (vLLM's own hashes never match the keys it computes)."""

from __future__ import annotations

import msgspec

from pipeline.router.index import PrefixIndex
from schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from stages.prefix_keys import PromptMedia, block_keys, expand, prompt_block_keys
from stages.vllm_engine.block_keys import VllmBlockKeys

SIZE = 16
PAD = 99  # an image's placeholder token


def _prompt() -> tuple[list[int], list[PromptMedia]]:
    prompt = [*range(1, 6), PAD, *range(10, 40)]
    return prompt, [PromptMedia(5, 40, "digest-of-image-one")]


def _stored(hashes: list[int], parent: int | None, tokens: list[int]) -> BlockStored:
    return BlockStored(hashes, parent, tokens, SIZE, None, "CPU", None)


def _rewritten(keys: VllmBlockKeys, *events: object) -> list[object]:
    payload = msgspec.msgpack.encode(KVEventBatch(1.0, list(events)))  # type: ignore[arg-type]
    out = keys.rewrite(payload)
    return [] if out is None else msgspec.msgpack.decode(out, type=KVEventBatch).events


def test_the_blocks_of_a_prompt_it_sent_get_the_keys_the_router_computes() -> None:
    keys = VllmBlockKeys()
    prompt, media = _prompt()
    keys.learn(prompt, media)
    ids, _, _ = expand(prompt, media)
    expected = prompt_block_keys(prompt, media, SIZE)
    assert len(expected) == len(ids) // SIZE == 4
    vllm = [7001, 7002, 7003, 7004]  # vLLM's own hashes: nothing like mmpipe's
    # vLLM stores a prompt's blocks in runs as it computes them, each after the one before.
    first = _rewritten(keys, _stored(vllm[:2], None, ids[: 2 * SIZE]))
    rest = _rewritten(keys, _stored(vllm[2:], vllm[1], ids[2 * SIZE : 4 * SIZE]))
    assert first == [_stored(expected[:2], None, ids[: 2 * SIZE])]
    assert rest == [_stored(expected[2:], expected[1], ids[2 * SIZE : 4 * SIZE])]

    # The router's index, fed the rewritten events, finds the prompt there.
    index = PrefixIndex()
    index.apply("vllm-worker", [*first, *rest])  # type: ignore[list-item]
    assert index.overlaps(expected) == {"vllm-worker": 4}

    assert _rewritten(keys, BlockRemoved([vllm[3], 12345], "CPU")) == [BlockRemoved([expected[3]], "CPU")]
    assert _rewritten(keys, AllBlocksCleared()) == [AllBlocksCleared()]
    assert _rewritten(keys, BlockRemoved(vllm[:2], "CPU")) == []  # cleared: nothing of them left to name


def test_a_block_no_prompt_here_explains_is_keyed_only_where_it_shows_no_media() -> None:
    keys = VllmBlockKeys()
    prompt, media = _prompt()
    keys.learn(prompt, media)
    ids, _, _ = expand(prompt, media)
    # Text alone (a decode worker's blocks, whose prompt came by the KV connector): keyed from its tokens.
    text = list(range(200, 200 + 2 * SIZE))
    assert _rewritten(keys, _stored([8001, 8002], None, text)) == [_stored(block_keys(text, SIZE), None, text)]
    # An image in a prompt nobody sent here: the run ends before the block that shows it.
    other = [*range(300, 300 + SIZE), 7, *[PAD] * 15]
    [cut] = _rewritten(keys, _stored([9001, 9002], None, other))
    assert cut == _stored(block_keys(other[:SIZE], SIZE), None, other[:SIZE])
    # A run whose parent was never relayed: nothing to say about it.
    assert _rewritten(keys, _stored([9101], 424242, ids[:SIZE])) == []
    assert keys.unexplained == 2


def test_blocks_of_another_size_are_keyed_from_the_prompts_kept() -> None:
    keys = VllmBlockKeys()
    prompt, media = _prompt()
    keys.learn(prompt, media)
    ids, _, _ = expand(prompt, media)
    size = 32
    [stored] = _rewritten(keys, BlockStored([5001], None, ids[:size], size, None, "GPU", None))
    assert stored.block_hashes == prompt_block_keys(prompt, media, size)[:1]  # type: ignore[attr-defined]
