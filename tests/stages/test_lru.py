"""stages.media.lru: the byte-bounded LRU under the media caches."""

from __future__ import annotations

import pytest

from stages.media.lru import ByteLRU


def lru(capacity: int, *, max_entries: int | None = None) -> tuple[ByteLRU[str, bytes], list[str]]:
    """An LRU of bytes sized by their length, and the keys it evicts, in order."""
    evicted: list[str] = []
    cache: ByteLRU[str, bytes] = ByteLRU(
        capacity, len, max_entries=max_entries, on_evict=lambda key, value: evicted.append(key)
    )
    return cache, evicted


def keys(cache: ByteLRU[str, bytes], *candidates: str) -> list[str]:
    return [k for k in candidates if k in cache]


def test_evicts_the_least_recently_put_first() -> None:
    cache, evicted = lru(30)
    for key in "abc":
        assert cache.put(key, b"x" * 10)
    assert cache.put("d", b"x" * 10)
    assert evicted == ["a"]
    assert keys(cache, *"abcd") == ["b", "c", "d"]
    assert (cache.bytes, len(cache)) == (30, 3)


def test_a_get_makes_an_entry_most_recent() -> None:
    cache, evicted = lru(30)
    for key in "abc":
        cache.put(key, key.encode() * 10)
    assert cache.get("a") == b"a" * 10
    cache.put("d", b"x" * 10)
    cache.put("e", b"x" * 10)
    assert evicted == ["b", "c"]
    assert keys(cache, *"abcde") == ["a", "d", "e"]


def test_a_miss_or_contains_changes_no_order() -> None:
    cache, evicted = lru(20)
    cache.put("a", b"x" * 10)
    cache.put("b", b"x" * 10)
    assert cache.get("nope") is None
    assert "a" in cache
    cache.put("c", b"x" * 10)
    assert evicted == ["a"]


def test_several_go_to_fit_a_big_one_oldest_first() -> None:
    cache, evicted = lru(40)
    for key in "abcd":
        cache.put(key, b"x" * 10)
    cache.get("a")
    assert cache.put("big", b"x" * 25)
    assert evicted == ["b", "c", "d"]
    assert keys(cache, "a", "b", "c", "d", "big") == ["a", "big"]
    assert cache.bytes == 35


def test_replacing_recounts_bytes_refreshes_recency_and_evicts_nothing_extra() -> None:
    cache, evicted = lru(30)
    cache.put("a", b"x" * 10)
    cache.put("b", b"x" * 10)
    assert cache.put("a", b"x" * 20)  # 10 + 20 fits once a's old 10 are gone: nothing evicted
    assert evicted == []
    assert (cache.bytes, len(cache)) == (30, 2)
    cache.put("c", b"x" * 5)  # the replacement made a the most recent: b goes
    assert evicted == ["b"]
    assert cache.get("a") == b"x" * 20
    assert cache.put("c", b"")
    assert (cache.bytes, len(cache)) == (20, 2)


def test_pop_and_clear_give_back_their_bytes() -> None:
    cache, evicted = lru(30)
    cache.put("a", b"x" * 10)
    cache.put("b", b"x" * 15)
    assert cache.pop("a") == b"x" * 10
    assert cache.pop("a") is None
    assert (cache.bytes, len(cache)) == (15, 1)
    assert cache.put("c", b"x" * 15)  # fits in what a gave back
    cache.clear()
    assert (cache.bytes, len(cache), cache.get("b")) == (0, 0, None)
    assert evicted == []  # pop and clear are not evictions


def test_the_size_counted_is_the_one_at_put() -> None:
    cache: ByteLRU[str, bytearray] = ByteLRU(30, len)
    value = bytearray(10)
    cache.put("a", value)
    value.extend(bytes(50))  # the caller changes it afterwards
    assert cache.pop("a") is value
    assert cache.bytes == 0


def test_an_entry_larger_than_the_capacity_is_refused_and_changes_nothing() -> None:
    cache, evicted = lru(20)
    cache.put("a", b"x" * 10)
    cache.put("b", b"x" * 10)
    assert not cache.put("big", b"x" * 21)
    assert not cache.put("a", b"x" * 21)  # a present key keeps its entry
    assert evicted == []
    assert (cache.bytes, len(cache), cache.get("a")) == (20, 2, b"x" * 10)
    assert cache.put("exact", b"x" * 20)  # exactly the capacity fits, evicting everything else
    assert evicted == ["b", "a"]
    assert (cache.bytes, len(cache)) == (20, 1)


def test_empty_values_are_held_at_no_cost() -> None:
    cache, _ = lru(10)
    assert cache.put("e", b"")
    assert (cache.bytes, len(cache), cache.get("e")) == (0, 1, b"")


def test_capacity_zero_holds_nothing() -> None:
    cache, evicted = lru(0)
    assert not cache.put("a", b"x")
    assert not cache.put("e", b"")  # not even an empty value
    assert (cache.bytes, len(cache), cache.get("e"), evicted) == (0, 0, None, [])
    assert cache.capacity == 0


def test_max_entries_bounds_the_count_too() -> None:
    cache, evicted = lru(100, max_entries=2)
    for key in "abc":
        assert cache.put(key, b"x")
    assert evicted == ["a"]
    assert cache.put("b", b"y")  # a replacement does not count twice
    assert evicted == ["a"]
    assert keys(cache, *"abc") == ["b", "c"]
    off, _ = lru(100, max_entries=0)
    assert not off.put("a", b"x") and len(off) == 0


def test_bad_bounds_are_errors() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        ByteLRU(-1, len)
    with pytest.raises(ValueError, match=">= 0"):
        ByteLRU(10, len, max_entries=-1)
