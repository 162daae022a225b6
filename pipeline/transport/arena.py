"""A first-fit allocator over one fixed byte range.

NIXL memory registration is slow and every registration must be re-published
to peers, so each agent registers one arena once and carves regions out of it
here. Offsets are aligned so a region can hold any dtype.
"""

from __future__ import annotations

import bisect

from pipeline.transport.packing import ALIGN, align_up


class FirstFit:
    """Offsets into ``[0, size)``; ``alloc`` returns None when nothing fits."""

    def __init__(self, size: int, align: int = ALIGN) -> None:
        self.size = size
        self.align = align
        # Sorted, coalesced (offset, length) holes.
        self._free: list[tuple[int, int]] = [(0, size)] if size > 0 else []
        self._used: dict[int, int] = {}
        self.used_bytes = 0

    def alloc(self, nbytes: int) -> int | None:
        # At least one unit, so every region has a distinct offset.
        need = align_up(max(nbytes, 1), self.align)
        for i, (off, length) in enumerate(self._free):
            if length >= need:
                if length == need:
                    del self._free[i]
                else:
                    self._free[i] = (off + need, length - need)
                self._used[off] = need
                self.used_bytes += need
                return off
        return None

    def free(self, offset: int) -> int:
        """Give a region back; returns its (aligned) length."""
        length = self._used.pop(offset)
        self.used_bytes -= length
        i = bisect.bisect_left(self._free, (offset, 0))
        start, end = offset, offset + length
        if i < len(self._free) and self._free[i][0] == end:
            end += self._free[i][1]
            del self._free[i]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:
            start = self._free[i - 1][0]
            del self._free[i - 1]
            i -= 1
        self._free.insert(i, (start, end - start))
        return length

    def fits(self, nbytes: int) -> bool:
        need = align_up(max(nbytes, 1), self.align)
        return any(length >= need for _, length in self._free)

    def region_size(self, nbytes: int) -> int:
        return align_up(max(nbytes, 1), self.align)
