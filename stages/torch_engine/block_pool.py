"""Which blocks of the paged KV cache are free, and which hold a prefix
another prompt may reuse.

The batch decoder's keys and values live in fixed-size blocks of one pool
(``[layers, blocks, kv_heads, block_size, head_dim]``); a sequence holds a
list of them, its block table. Block 0 is never handed out: it is where
writes nobody reads go (a padding row of a step, a prompt's padding past
its last block), so that every table entry not in use can point at it.

Free blocks go out lowest first and come back in the order they were
freed: consecutive blocks often stay consecutive, and a transfer into them
is then one run of bytes, not one per block.

Prefix caching (vLLM v1's automatic prefix caching): a full block whose
keys and values are computed can be ``register``-ed under its content key
(``stages.prefix_keys``: its tokens, the media they show and
the blocks before it). Several sequences may hold such a block at once
(``share``); once none does, it stays cached but idle, and is only taken
for new content when no never-cached block is left, least recently used
first (the last block of a sequence before its first: a prefix outlives
its tails).
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stages.torch_engine.kv_event_log import KvEventLog

NULL_BLOCK = 0


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"a KV pool of {num_blocks} blocks: two at least (block 0 is the null block)")
        self.num_blocks = num_blocks
        # Blocks holding nothing worth keeping.
        self._free = collections.deque(range(1, num_blocks))
        # Sequences holding each block handed out.
        self._holders: dict[int, int] = {}
        # Cached content: block -> key and key -> block.
        self._key_of: dict[int, int] = {}
        self._block_of: dict[int, int] = {}
        # Cached blocks no sequence holds, least recently used first.
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()
        # Cached blocks taken for new content since start (vLLM's evictions).
        self.evicted = 0
        # Where what the cache forgets is told (KV events); the engine tells what it caches.
        self.log: KvEventLog | None = None

    @property
    def num_free(self) -> int:
        """Blocks ``allocate`` can hand out: the free ones and the idle cached ones."""
        return len(self._free) + len(self._idle)

    @property
    def num_cached(self) -> int:
        return len(self._key_of)

    @property
    def capacity(self) -> int:
        """Blocks a sequence can ever hold (all but the null block)."""
        return self.num_blocks - 1

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks for new content: never-cached ones first, then the
        least recently used idle cached ones, whose content is forgotten."""
        if n > self.num_free:
            raise RuntimeError(f"{n} KV blocks asked for, {self.num_free} free")
        out, forgotten = [], []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._idle.popitem(last=False)
                key = self._key_of.pop(block)
                del self._block_of[key]
                forgotten.append(key)
                self.evicted += 1
            self._holders[block] = 1
            out.append(block)
        if forgotten and self.log is not None:
            self.log.removed(forgotten)
        return out

    def free(self, blocks: list[int]) -> None:
        """Each block one holder fewer; a block no one holds is free again,
        or idle where it is cached (a sequence's last blocks first in line
        to be taken: they are the least likely to be shared)."""
        idle = []
        for block in blocks:
            held = self._holders.pop(block, 0) - 1
            if held > 0:
                self._holders[block] = held
            elif block in self._key_of:
                idle.append(block)
            else:
                self._free.append(block)
        for block in reversed(idle):
            self._idle[block] = None

    def cached(self, keys: list[int]) -> list[int]:
        """The blocks holding the longest run of ``keys`` from the first (none
        held for the caller: ``share`` them before another ``allocate``)."""
        out = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            out.append(block)
        return out

    def share(self, blocks: list[int]) -> None:
        """One holder more for each of ``blocks`` (cached ones ``cached`` found)."""
        for block in blocks:
            if block not in self._key_of:
                raise ValueError(f"block {block} holds no cached content")
            self._idle.pop(block, None)
            self._holders[block] = self._holders.get(block, 0) + 1

    def register(self, block: int, key: int) -> bool:
        """``block`` (held, full, computed) holds the content ``key`` names;
        False where another block holds it already (this one stays uncached)."""
        if block not in self._holders:
            raise ValueError(f"block {block} is not held")
        if key in self._block_of or block in self._key_of:
            return False
        self._key_of[block] = key
        self._block_of[key] = block
        return True

    def is_cached(self, block: int) -> bool:
        return block in self._key_of

    def reset(self) -> int:
        """Forget every cached content (``POST /v1/cache/reset``): idle blocks
        are free again, held ones become plain blocks of their holders.
        Returns how many were cached."""
        n = len(self._key_of)
        self._free.extend(self._idle)
        self._idle.clear()
        self._key_of.clear()
        self._block_of.clear()
        if self.log is not None:
            self.log.cleared()
        return n
