"""Which blocks of the paged KV cache are free.

The batch decoder's keys and values live in fixed-size blocks of one pool
(``[layers, blocks, kv_heads, block_size, head_dim]``); a sequence holds a
list of them, its block table. Block 0 is never handed out: it is where
writes nobody reads go (a padding row of a step, a prompt's padding past
its last block), so that every table entry not in use can point at it.

Free blocks go out lowest first and come back in the order they were
freed: consecutive blocks often stay consecutive, and a transfer into them
is then one run of bytes, not one per block.
"""

from __future__ import annotations

import collections

NULL_BLOCK = 0


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"a KV pool of {num_blocks} blocks: two at least (block 0 is the null block)")
        self.num_blocks = num_blocks
        self._free = collections.deque(range(1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Blocks a sequence can ever hold (all but the null block)."""
        return self.num_blocks - 1

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"{n} KV blocks asked for, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)
