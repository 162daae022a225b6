"""Which worker holds which cached KV blocks, kept from their KV events.

The keys are the engines' own block keys (stages/prefix_keys.py), so a
router that computes a prompt's keys the same way finds its cached prefix
exactly, media included. A media item's token count is what a prompt's
keys need and the processor does not know before the item is encoded:
the index learns the lengths of the placeholder runs in the blocks it
sees stored, and the router tries those.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

from schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

# Distinct run lengths remembered per placeholder token (most recent kept).
_MAX_LENGTHS = 16


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}
        self._blocks: dict[str, set[int]] = collections.defaultdict(set)
        # A block's trailing run of one placeholder token: (token, length).
        self._trailing: dict[int, tuple[int, int]] = {}
        self._lengths: dict[int, collections.OrderedDict[int, None]] = collections.defaultdict(collections.OrderedDict)
        self.block_sizes: dict[str, int] = {}
        self.placeholders: set[int] = set()

    def blocks_of(self, worker: str) -> int:
        return len(self._blocks.get(worker, ()))

    def apply(self, worker: str, events: Iterable[KVCacheEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(worker, event)
            elif isinstance(event, BlockRemoved):
                for key in event.block_hashes:
                    self._drop(worker, key)
            elif isinstance(event, AllBlocksCleared):
                self.forget(worker)

    def forget(self, worker: str) -> None:
        """Every block of ``worker`` (cleared, or the worker gone)."""
        for key in list(self._blocks.pop(worker, ())):
            self._drop(worker, key)

    def overlaps(self, keys: list[int]) -> dict[str, int]:
        """How many of ``keys``, from the first, each worker holds in a row."""
        found: dict[str, int] = {}
        alive: set[str] | None = None
        for i, key in enumerate(keys):
            holders = self._holders.get(key)
            alive = set(holders or ()) if alive is None else alive & (holders or set())
            if not alive:
                break
            for worker in alive:
                found[worker] = i + 1
        return found

    def lengths(self, placeholder: int) -> list[int]:
        """Token counts seen for media of ``placeholder``, the latest first."""
        return list(reversed(self._lengths.get(placeholder, {})))

    def _stored(self, worker: str, event: BlockStored) -> None:
        self.block_sizes[worker] = event.block_size
        token, run = self._trailing.get(event.parent_block_hash, (-1, 0)) if event.parent_block_hash else (-1, 0)
        size = event.block_size
        for i, key in enumerate(event.block_hashes):
            for t in event.token_ids[i * size : (i + 1) * size]:
                if t == token and run:
                    run += 1
                    continue
                if run:
                    self._seen_length(token, run)
                token, run = (t, 1) if t in self.placeholders else (-1, 0)
            self._holders.setdefault(key, set()).add(worker)
            self._blocks[worker].add(key)
            if run:
                self._trailing[key] = (token, run)

    def _seen_length(self, token: int, length: int) -> None:
        lengths = self._lengths[token]
        lengths[length] = None
        lengths.move_to_end(length)
        while len(lengths) > _MAX_LENGTHS:
            lengths.popitem(last=False)

    def _drop(self, worker: str, key: int) -> None:
        self._blocks.get(worker, set()).discard(key)
        holders = self._holders.get(key)
        if holders is None:
            return
        holders.discard(worker)
        if not holders:
            del self._holders[key]
            self._trailing.pop(key, None)
