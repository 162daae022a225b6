"""Which sequence sits in which slot of the batch decoder's cache.

A step runs rows ``0..n-1`` of the cache, so taken slots are kept low: a
freed slot is refilled with the last one's cache. Two things may not move:
a slot that another worker's KV cache is being READ into (the transfer
writes its address; ``receiving``), and, after a READ that could not be
cancelled, that slot for good (it may still be written). Where the last
slot cannot move, a freed slot stays a hole until a new sequence takes it.

Every row steps (one batch shape whatever the mix): a hole and a receiving
slot take a step nobody reads. A receiving row writes only the position
after the cache being received, which its first real step writes again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stages.batch_decoder import BatchDecoder
    from stages.engine.torch_engine import Sequence


class SlotTable:
    def __init__(self, decoder: BatchDecoder) -> None:
        self.decoder = decoder
        self.rows: list[Sequence | None] = []

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def taken(self) -> int:
        return sum(row is not None for row in self.rows)

    def has_room(self) -> bool:
        return None in self.rows or len(self.rows) < self.decoder.max_slots

    def take(self, seq: Sequence) -> int:
        """A slot for ``seq`` (the lowest hole, else the next row); sets ``seq.slot``."""
        try:
            slot = self.rows.index(None)
            self.rows[slot] = seq
        except ValueError:
            if len(self.rows) >= self.decoder.max_slots:
                raise RuntimeError("no free decoder slot") from None
            slot = len(self.rows)
            self.rows.append(seq)
        seq.slot = slot
        return slot

    def free(self, seq: Sequence) -> None:
        slot, seq.slot = seq.slot, -1
        last = self.rows[-1]
        if last is seq:
            self.rows.pop()
        elif last is not None and not last.receiving:
            self.rows.pop()
            self.decoder.move(last.slot, slot, last.length - 1)
            last.slot = slot
            self.rows[slot] = last
        else:
            self.rows[slot] = None
        while self.rows and self.rows[-1] is None:
            self.rows.pop()

    def step_inputs(self) -> tuple[list[int], list[int], list[int]]:
        """Each row's last token, rotary position and write position."""
        tokens: list[int] = []
        positions: list[int] = []
        write_at: list[int] = []
        for seq in self.rows:
            live = seq is not None and not seq.receiving
            tokens.append(seq.output_ids[-1] if live else 0)  # type: ignore[union-attr]
            positions.append(seq.length - 1 + seq.rope_delta if live else 0)  # type: ignore[union-attr]
            write_at.append(seq.length - 1 if seq is not None else 0)
        return tokens, positions, write_at
