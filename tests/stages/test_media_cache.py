"""stages.media.cache: the embedding cache's LRU order, byte accounting, refusals, keys and metrics.

Every test gives its cache a name of its own, so the process-wide Prometheus series of one test
never carry counts from another.
"""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest
import torch
from prometheus_client import REGISTRY

from stages.media import CachedEmbedding, EmbeddingCache, content_key

_names = itertools.count()


def fresh_name() -> str:
    return f"test-{next(_names)}"


def emb(rows: int, dim: int = 4, dtype: torch.dtype = torch.float32, fill: float = 1.0) -> CachedEmbedding:
    """``rows`` x ``dim`` embeddings: ``rows * dim * itemsize`` bytes."""
    return CachedEmbedding(torch.full((rows, dim), fill, dtype=dtype), (1, rows, 1))


def metric(what: str, name: str) -> float | None:
    return REGISTRY.get_sample_value(f"mmpipe_embedding_cache_{what}", {"name": name})


# -- CachedEmbedding -------------------------------------------------------------------------------


def test_entries_hold_a_contiguous_cpu_copy() -> None:
    src = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    view = src.t()  # non-contiguous, and a view of src's storage
    value = CachedEmbedding(view, [2, 3])
    assert value.embeddings.is_contiguous()
    assert value.embeddings.device.type == "cpu"
    assert torch.equal(value.embeddings, view)
    assert value.embeddings.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()
    src.zero_()  # the caller reuses or frees its tensor: the entry does not change with it
    assert value.embeddings[1, 0] == 1.0
    assert value.grid == (2, 3)
    assert value.nbytes == 24 * 4


def test_entries_drop_autograd_and_count_their_dtype() -> None:
    src = torch.ones(3, 5, dtype=torch.bfloat16, requires_grad=True)
    value = CachedEmbedding(src, (1, 3, 1))
    assert not value.embeddings.requires_grad
    assert value.embeddings.dtype == torch.bfloat16
    assert value.nbytes == 3 * 5 * 2


def test_a_narrow_view_holds_only_its_own_bytes() -> None:
    big = torch.zeros(1000, 4)
    value = CachedEmbedding(big[:2], (1, 2, 1))
    assert value.nbytes == value.embeddings.untyped_storage().nbytes() == 2 * 4 * 4


# -- LRU ------------------------------------------------------------------------------------------


def test_lru_order_and_exact_byte_accounting() -> None:
    cache = EmbeddingCache(3 * 64, fresh_name())
    a, b, c, d = emb(4), emb(4), emb(4), emb(4)  # 64 bytes each
    assert cache.put("a", a) and cache.put("b", b) and cache.put("c", c)
    assert (cache.bytes, cache.entries, cache.capacity) == (192, 3, 192)
    assert cache.get("a") is a  # a is now the most recent; b the least
    assert cache.put("d", d)
    assert cache.get("b") is None
    assert cache.get("a") is a and cache.get("c") is c and cache.get("d") is d
    assert (cache.bytes, cache.entries) == (192, 3)
    assert cache.stats() == {"hits": 4, "misses": 1, "evictions": 1, "refused": 0, "bytes": 192, "entries": 3}


def test_put_under_a_present_key_replaces_and_recounts() -> None:
    cache = EmbeddingCache(1000, fresh_name())
    assert cache.put("k", emb(4))
    bigger = emb(10)
    assert cache.put("k", bigger)
    assert (cache.bytes, cache.entries) == (160, 1)
    assert cache.get("k") is bigger
    assert cache.stats()["evictions"] == 0


def test_replacing_an_entry_makes_it_most_recent() -> None:
    cache = EmbeddingCache(2 * 64, fresh_name())
    cache.put("a", emb(4))
    cache.put("b", emb(4))
    cache.put("a", emb(4))
    cache.put("c", emb(4))
    assert cache.get("b") is None
    assert cache.get("a") is not None and cache.get("c") is not None


def test_oversize_entries_are_refused_and_evict_nothing() -> None:
    name = fresh_name()
    cache = EmbeddingCache(100, name)
    kept = emb(4)
    assert cache.put("a", kept)
    assert not cache.put("big", emb(7))  # 112 bytes > 100
    assert not cache.put("a", emb(7))  # refused for a present key too; the old entry stays
    assert cache.get("big") is None
    assert cache.get("a") is kept
    assert cache.stats() == {"hits": 1, "misses": 1, "evictions": 0, "refused": 2, "bytes": 64, "entries": 1}
    assert metric("refused_total", name) == 2


def test_an_entry_of_exactly_the_capacity_fits() -> None:
    cache = EmbeddingCache(64, fresh_name())
    assert cache.put("a", emb(4))
    assert cache.bytes == cache.capacity == 64


def test_several_are_evicted_to_fit_a_big_one() -> None:
    name = fresh_name()
    cache = EmbeddingCache(10 * 16, name)
    for i in range(10):
        assert cache.put(f"s{i}", emb(1))  # 16 bytes each: full
    cache.get("s0")  # s0 most recent: it survives, s1..s7 go
    assert cache.put("big", emb(7))  # 112 bytes: needs 7 of the 16-byte entries gone
    assert cache.stats()["evictions"] == 7
    assert metric("evictions_total", name) == 7
    survivors = [k for k in [f"s{i}" for i in range(10)] if cache.get(k) is not None]
    assert survivors == ["s0", "s8", "s9"]
    assert (cache.bytes, cache.entries) == (112 + 3 * 16, 4)
    assert cache.bytes <= cache.capacity


def test_empty_tensors_are_cached_at_no_cost() -> None:
    cache = EmbeddingCache(16, fresh_name())
    assert cache.put("e", emb(0))
    assert (cache.bytes, cache.entries) == (0, 1)
    assert cache.get("e") is not None


def test_capacity_zero_disables_the_cache() -> None:
    name = fresh_name()
    cache = EmbeddingCache(0, name)
    assert not cache.put("a", emb(1))
    assert cache.get("a") is None
    assert cache.get("b") is None
    assert cache.stats() == {"hits": 0, "misses": 2, "evictions": 0, "refused": 0, "bytes": 0, "entries": 0}
    assert metric("misses_total", name) == 2
    # No other series exists for a disabled cache: not even at 0.
    for what in ("hits_total", "evictions_total", "refused_total", "bytes", "entries"):
        assert metric(what, name) is None, what


def test_negative_capacity_is_an_error() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        EmbeddingCache(-1, fresh_name())


# -- metrics --------------------------------------------------------------------------------------


def test_metrics_move_with_the_cache() -> None:
    name = fresh_name()
    cache = EmbeddingCache(2 * 64, name)
    # An enabled cache exports every series from the start.
    assert [metric(w, name) for w in ("hits_total", "misses_total", "evictions_total", "refused_total")] == [0] * 4
    assert metric("bytes", name) == 0 and metric("entries", name) == 0
    cache.get("a")
    cache.put("a", emb(4))
    cache.get("a")
    cache.put("b", emb(4))
    cache.put("c", emb(4))  # evicts a
    cache.put("huge", emb(100))  # refused
    assert metric("hits_total", name) == 1
    assert metric("misses_total", name) == 1
    assert metric("evictions_total", name) == 1
    assert metric("refused_total", name) == 1
    assert metric("bytes", name) == 128
    assert metric("entries", name) == 2
    # The default name labels the encode role's cache.
    assert EmbeddingCache(0).name == "encode"


# -- keys -----------------------------------------------------------------------------------------


def test_content_key_is_of_the_bytes_not_the_url() -> None:
    data = b"\x89PNG same image bytes"
    # Whichever URL the bytes came from, the key only sees the bytes.
    from_cdn = content_key(data, model="qwen2-vl-7b", kind="image")
    from_data_url = content_key(bytes(bytearray(data)), model="qwen2-vl-7b", kind="image")
    assert from_cdn == from_data_url
    assert len(from_cdn) == 64 and int(from_cdn, 16) >= 0
    assert content_key(data + b"!", model="qwen2-vl-7b", kind="image") != from_cdn


def test_content_key_differs_by_model_kind_and_options() -> None:
    data = b"the same clip"
    keys = {
        content_key(data, model="qwen2-vl-7b", kind="video", options="fps=2"),
        content_key(data, model="qwen2-vl-7b", kind="video", options="fps=1"),
        content_key(data, model="qwen2-vl-7b", kind="video", options="num_frames=8"),
        content_key(data, model="qwen2-vl-7b", kind="video"),
        content_key(data, model="qwen2-vl-2b", kind="video", options="fps=2"),
        content_key(data, model="qwen2-vl-7b", kind="image", options="fps=2"),
    }
    assert len(keys) == 6


def test_content_key_fields_do_not_run_into_each_other() -> None:
    # Length-prefixed: moving a character across a field boundary changes the key.
    assert content_key(b"x", model="ab", kind="c") != content_key(b"x", model="a", kind="bc")
    assert content_key(b"x", model="m", kind="k", options="o") != content_key(b"ox", model="m", kind="k")
    assert content_key(b"", model="m", kind="k", options="") == content_key(b"", model="m", kind="k")


def test_importing_stages_media_does_not_import_torch() -> None:
    # The bridge imports stages.media for the policy; the cache must not drag torch in with it.
    code = "import sys, stages.media; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_listener_hears_each_key_stored_and_evicted() -> None:
    """What an encoding worker relays to routers: held, then let go to make room."""
    cache = EmbeddingCache(capacity_bytes=2 * 64 * 4, name="listened")
    heard: list[tuple[str, bool]] = []
    cache.listener = lambda key, stored: heard.append((key, stored))
    for key in ("a", "b", "c"):
        assert cache.put(key, CachedEmbedding(torch.zeros(64), (1, 8, 8)))
    assert heard == [("a", True), ("b", True), ("a", False), ("c", True)]
    assert not cache.put("huge", CachedEmbedding(torch.zeros(1024), (1, 32, 32)))
    assert heard[-1] == ("c", True)
