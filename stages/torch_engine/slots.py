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

A sequence may have steps launched whose tokens are not read yet
(``inflight``): its cache already holds (or will, in stream order) those
steps' inputs, so positions, a move's length and the next input count them,
and its next token is fed from the device row of its last launch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stages.torch_engine.batch_decoder import StepInputs

if TYPE_CHECKING:
    from stages.torch_engine.batch_decoder import BatchDecoder
    from stages.torch_engine.sequence import Sequence


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
            # Queued after any launched step of ``last``: its writes move too.
            self.decoder.move(last.slot, slot, last.length - 1 + last.inflight)
            last.slot = slot
            self.rows[slot] = last
        else:
            self.rows[slot] = None
        while self.rows and self.rows[-1] is None:
            self.rows.pop()

    def step_inputs(self, asked: set[int] | None = None) -> StepInputs:
        """Each row's inputs to a step (``asked``: the slots whose tokens are
        wanted; default every live row)."""
        inputs = StepInputs([], [], [], [], [], [])
        for row, seq in enumerate(self.rows):
            if seq is None or seq.receiving:
                # Nobody reads this row's step: a hole writes position 0 of a free
                # slot, a receiving slot the position after its incoming cache.
                for column, value in zip(inputs, (0, 0, seq.length - 1 if seq else 0, -1, 0, 0), strict=True):
                    column.append(value)
                continue
            ahead = seq.length - 1 + seq.inflight
            fed = seq.feed_row >= 0
            inputs.tokens.append(0 if fed else seq.output_ids[-1])
            inputs.positions.append(ahead + seq.rope_delta)
            inputs.write_at.append(ahead)
            inputs.feed.append(seq.feed_row if fed else -1)
            inputs.mask_eos.append(int(seq.num_generated + seq.inflight < seq.sampling.min_tokens))
            inputs.asked.append(int(asked is None or row in asked))
        return inputs
