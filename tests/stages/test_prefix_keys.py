"""Content keys of a prompt's KV blocks (stages/prefix_keys.py):
equal only where the tokens before and in a block and the media they show
are equal."""

from __future__ import annotations

from stages.prefix_keys import MediaSpan, block_keys

IMAGE = 151655  # a placeholder id: the same for every image


def test_a_prompt_gets_a_key_per_full_block_and_the_same_prompt_the_same_keys() -> None:
    ids = list(range(100, 150))  # 50 tokens: three full blocks of 16 and two tokens more
    keys = block_keys(ids, 16)
    assert len(keys) == 3 and len(set(keys)) == 3
    assert block_keys(list(ids), 16) == keys
    assert all(0 <= key < 2**64 for key in keys)
    assert block_keys(ids[:15], 16) == []


def test_a_changed_token_changes_its_blocks_key_and_every_key_after_it() -> None:
    ids = list(range(100, 164))
    changed = [*ids[:20], 7, *ids[21:]]  # in the second block
    a, b = block_keys(ids, 16), block_keys(changed, 16)
    assert a[0] == b[0]
    assert all(x != y for x, y in zip(a[1:], b[1:], strict=True))


def test_equal_placeholders_showing_other_images_share_only_the_blocks_before_them() -> None:
    ids = list(range(100, 120)) + [IMAGE] * 40 + list(range(200, 220))
    one = block_keys(ids, 16, [MediaSpan(20, 40, "sha256:aaa")])
    other = block_keys(ids, 16, [MediaSpan(20, 40, "sha256:bbb")])
    again = block_keys(ids, 16, [MediaSpan(20, 40, "sha256:aaa")])
    assert one[0] == other[0]  # tokens 0..15: no image yet
    assert all(x != y for x, y in zip(one[1:], other[1:], strict=True))  # block 1 holds its first 12 tokens
    assert one == again


def test_a_salt_keeps_two_tenants_equal_prompts_apart() -> None:
    ids = list(range(100, 148))
    assert set(block_keys(ids, 16, salt="a")).isdisjoint(block_keys(ids, 16, salt="b"))
    assert block_keys(ids, 16, salt="a") == block_keys(ids, 16, salt="a")
