"""Which sequence runs in which row of the batch decoder, and which blocks
of the paged KV pool hold its cache.

A sequence is given, when it joins, every block it can come to need: its
prompt and ``max_tokens`` (positions below ``prompt_len + max_tokens``; a
step launched past its last token writes the last of them). Admission is
then by memory (free blocks) as well as by rows, and a running sequence
never waits for a block.

A step runs rows ``0..n-1``, so taken rows are kept low: a freed row is
refilled with the last one's sequence (its block table moves, not its
cache). A sequence whose cache is still arriving (``hold``: another
worker's KV cache is being READ into its blocks) holds blocks and a
promise of a row, not a row: no step runs for it until ``place``. After a
READ that could not be cancelled, its blocks are never used again
(``leak``).

A sequence may have steps launched whose tokens are not read yet
(``inflight``): its cache already holds (or will, in stream order) those
steps' inputs, so positions and the next input count them, and its next
token is fed from the device row of its last launch.
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
        self.rows: list[Sequence] = []
        # Rows promised to sequences whose cache is arriving.
        self.promised = 0

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def taken(self) -> int:
        return len(self.rows) + self.promised

    def blocks_needed(self, tokens: int) -> int:
        return self.decoder.blocks_for(tokens)

    def can_take(self, tokens: int) -> bool:
        """Whether a sequence that may grow to ``tokens`` positions can join now."""
        n = self.blocks_needed(tokens)
        decoder = self.decoder
        return self.taken < decoder.max_slots and n <= decoder.blocks_per_seq and decoder.pool.can_allocate(n)

    def take(self, seq: Sequence, tokens: int) -> int:
        """A row for ``seq`` (the next one) and its blocks; sets ``seq.slot``."""
        self._allocate(seq, tokens)
        return self._place(seq)

    def hold(self, seq: Sequence, tokens: int) -> None:
        """Blocks for ``seq`` and a row promised: its cache is to arrive."""
        self._allocate(seq, tokens)
        self.promised += 1

    def place(self, seq: Sequence) -> int:
        """The promised row for a sequence ``hold`` took, its cache arrived."""
        self.promised -= 1
        return self._place(seq)

    def free(self, seq: Sequence) -> None:
        """``seq``'s row (if any) and blocks go back."""
        self._leave(seq)
        self.decoder.pool.free(seq.blocks)
        seq.blocks = []

    def leak(self, seq: Sequence) -> None:
        """As ``free``, but its blocks stay out of use for good (a READ may still write them)."""
        self._leave(seq)
        seq.blocks = []

    def _allocate(self, seq: Sequence, tokens: int) -> None:
        if not self.can_take(tokens):
            raise RuntimeError("no decoder row or KV blocks free")
        seq.blocks = self.decoder.pool.allocate(self.blocks_needed(tokens))

    def _place(self, seq: Sequence) -> int:
        if len(self.rows) >= self.decoder.max_slots:
            raise RuntimeError("no free decoder row")
        row = len(self.rows)
        self.rows.append(seq)
        seq.slot = row
        self.decoder.set_table(row, seq.blocks)
        return row

    def _leave(self, seq: Sequence) -> None:
        if seq.slot < 0:
            if seq.receiving:
                self.promised -= 1
            return
        row, seq.slot = seq.slot, -1
        last = self.rows.pop()
        if last is seq:
            self.decoder.clear_row(row)
            return
        # Queued after any launched step of ``last``: that step read its old row.
        self.decoder.move_row(last.slot, row)
        last.slot = row
        self.rows[row] = last

    def step_inputs(self, asked: set[int] | None = None) -> StepInputs:
        """Each row's inputs to a step (``asked``: the rows whose tokens are
        wanted; default every row)."""
        inputs = StepInputs([], [], [], [], [], [])
        for row, seq in enumerate(self.rows):
            ahead = seq.length - 1 + seq.inflight
            fed = seq.feed_row >= 0
            inputs.tokens.append(0 if fed else seq.output_ids[-1])
            inputs.positions.append(ahead + seq.rope_delta)
            inputs.write_at.append(ahead)
            inputs.feed.append(seq.feed_row if fed else -1)
            inputs.mask_eos.append(int(seq.num_generated + seq.inflight < seq.sampling.min_tokens))
            inputs.asked.append(int(asked is None or row in asked))
        return inputs
