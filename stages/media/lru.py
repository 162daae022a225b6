"""A byte-bounded LRU: the eviction and byte accounting shared by the media caches.

The caches around it (embeddings, decoded media, fetched bytes) keep their own policy: metrics,
whether a present key is replaced, a time-to-live. This holds the entries in recency order,
the bytes they take, and evicts the least recently used to make room.

Thread-safety: none. Each cache using it is event-loop only, and no method here awaits.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class ByteLRU(Generic[K, V]):
    """Entries by key in recency order, their ``sizeof`` bytes held to ``capacity``.

    An entry larger than ``capacity`` is refused (``put`` returns False and changes nothing);
    ``capacity`` 0 holds nothing at all, not even an entry of 0 bytes. ``max_entries``, when
    given, bounds the count as well (0 holds nothing either). Values are never None: ``get``
    and ``pop`` answer None for a key not held. ``on_evict(key, value)`` is called for each
    entry evicted to make room, least recent first; not for one replaced under its own key,
    nor for ``pop`` or ``clear``.
    """

    def __init__(
        self,
        capacity: int,
        sizeof: Callable[[V], int],
        *,
        max_entries: int | None = None,
        on_evict: Callable[[K, V], None] | None = None,
    ) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0 bytes, got {capacity}")
        if max_entries is not None and max_entries < 0:
            raise ValueError(f"max_entries must be >= 0, got {max_entries}")
        self._capacity = capacity
        self._sizeof = sizeof
        self._max_entries = max_entries
        self._on_evict = on_evict
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._bytes = 0

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def bytes(self) -> int:
        """Bytes held now (the sum of each entry's size when it was put); never over ``capacity``."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: K) -> bool:
        """Whether ``key`` is held; does not change its recency."""
        return key in self._entries

    def get(self, key: K) -> V | None:
        """The value under ``key``, made most recently used, or None."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: K, value: V) -> bool:
        """Store ``value`` under ``key`` as most recently used, replacing any entry there and
        evicting the least recent to fit; False, changing nothing, when it alone is too large."""
        size = self._sizeof(value)
        if size > self._capacity or self._capacity == 0 or self._max_entries == 0:
            return False
        self.pop(key)
        while self._entries and (
            self._bytes + size > self._capacity
            or (self._max_entries is not None and len(self._entries) >= self._max_entries)
        ):
            evicted_key, (evicted, evicted_size) = self._entries.popitem(last=False)
            self._bytes -= evicted_size
            if self._on_evict is not None:
                self._on_evict(evicted_key, evicted)
        self._entries[key] = (value, size)
        self._bytes += size
        return True

    def pop(self, key: K) -> V | None:
        """Remove and return the value under ``key``, or None."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self._bytes -= entry[1]
        return entry[0]

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0
