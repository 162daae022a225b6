"""The KV pool's blocks (stages/torch_engine/block_pool.py): handed out
lowest first, shared where their content is cached, kept while idle and
taken least recently used first once nothing else is free."""

from __future__ import annotations

import pytest

from stages.torch_engine.block_pool import BlockPool


def test_blocks_go_out_lowest_first_never_block_zero_and_come_back_in_order() -> None:
    pool = BlockPool(6)
    assert pool.capacity == 5 and pool.num_free == 5
    a = pool.allocate(3)
    assert a == [1, 2, 3] and pool.num_free == 2
    with pytest.raises(RuntimeError, match="3 KV blocks asked for, 2 free"):
        pool.allocate(3)
    pool.free(a)
    assert pool.allocate(5) == [4, 5, 1, 2, 3]


def test_a_cached_prefix_is_found_shared_and_kept_while_one_sequence_holds_it() -> None:
    pool = BlockPool(8)
    first = pool.allocate(3)
    assert [pool.register(block, key) for block, key in zip(first, (11, 12, 13), strict=True)] == [True] * 3
    # The longest run of keys from the first: a prompt that parts after two blocks reuses two.
    assert pool.cached([11, 12, 99, 13]) == first[:2]
    pool.share(first[:2])
    pool.free(first)  # the first sequence ends: its blocks stay with the second
    assert pool.num_free == 7 - 2  # its third block is idle: free to take, still cached
    assert pool.cached([11, 12, 13]) == first
    pool.free(first[:2])
    assert pool.num_free == 7 and pool.num_cached == 3


def test_idle_cached_blocks_are_taken_only_when_nothing_else_is_free_least_recently_used_first() -> None:
    pool = BlockPool(6)
    old, new = pool.allocate(2), pool.allocate(2)
    for block, key in zip(old + new, (1, 2, 3, 4), strict=True):
        pool.register(block, key)
    pool.free(old)
    pool.free(new)
    assert pool.allocate(1) == [5]  # the never-cached one first
    # Then the idle ones, oldest first, and of one sequence its tail before its head.
    assert pool.allocate(2) == [old[1], old[0]]
    assert pool.evicted == 2 and pool.cached([1]) == [] and pool.cached([3, 4]) == new
    # A block found again is used again: it moves to the back of the line.
    pool.share(new[:1])
    pool.free(new[:1])
    assert pool.allocate(1) == [new[1]]


def test_content_is_cached_once_and_only_in_a_held_block() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.register(a, 7)
    assert not pool.register(b, 7)  # computed twice at once: the first stays the one found
    assert not pool.register(a, 8)
    pool.free([b])
    with pytest.raises(ValueError, match="not held"):
        pool.register(b, 9)
    with pytest.raises(ValueError, match="no cached content"):
        pool.share([b])
    assert pool.cached([7]) == [a]


def test_reset_forgets_every_cached_content_and_frees_what_no_one_holds() -> None:
    pool = BlockPool(5)
    held, idle = pool.allocate(2), pool.allocate(2)
    for block, key in zip(held + idle, (1, 2, 3, 4), strict=True):
        pool.register(block, key)
    pool.free(idle)
    assert pool.reset() == 4
    assert pool.num_cached == 0 and pool.cached([1]) == [] and pool.cached([3]) == []
    assert pool.num_free == 2
    pool.free(held)  # plain blocks now: back to the free list, not idle
    assert pool.num_free == 4 and pool.evicted == 0
