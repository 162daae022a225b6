"""What the prefix cache did, as KV events, until a publisher takes them.

The engine's thread records (a prompt's blocks cached, cached blocks taken
for new content, the cache cleared); the publisher's thread takes what
accumulated and sends it as one batch (pipeline/kv_events.py). Bounded: a
publisher that stops taking loses the oldest events, never blocks the
engine, and says how many (a router then resynchronises, as after a
missed sequence number).
"""

from __future__ import annotations

import collections
import threading

from schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

# Events kept for a publisher that falls behind.
MAX_PENDING = 100_000


class KvEventLog:
    def __init__(self, block_size: int, medium: str, max_pending: int = MAX_PENDING) -> None:
        self.block_size = block_size
        self.medium = medium
        self._events: collections.deque[KVCacheEvent] = collections.deque(maxlen=max_pending)
        self._lock = threading.Lock()
        self.dropped = 0
        # Set on each record: a publisher waiting on it sends at once.
        self.pending = threading.Event()

    def stored(self, keys: list[int], parent: int | None, token_ids: list[int]) -> None:
        self._add(BlockStored(keys, parent, token_ids, self.block_size, None, self.medium, None))

    def removed(self, keys: list[int]) -> None:
        self._add(BlockRemoved(keys, self.medium))

    def cleared(self) -> None:
        self._add(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        with self._lock:
            events = list(self._events)
            self._events.clear()
            self.pending.clear()
        return events

    def _add(self, event: KVCacheEvent) -> None:
        with self._lock:
            if len(self._events) == self._events.maxlen:
                self.dropped += 1
            self._events.append(event)
            self.pending.set()
