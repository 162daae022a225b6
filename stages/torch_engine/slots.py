"""Which sequence runs in which row of the batch decoder, and which blocks
of the paged KV pool hold its cache.

A sequence joins with the blocks its cache fills and is given one more
each time a step writes past them (``grow``). When the pool has none left,
the youngest running sequence is preempted (``swap_out``): its blocks are
copied to host memory and freed, and it waits until they can come back
(``swap_in``), then goes on where it was. Swapped, not recomputed as
vLLM's are: a decode worker holds no prompt to recompute from, and a
copy back costs a PCIe transfer, not a prefill. Its tokens go on from
where they were: nothing is emitted twice.

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
from stages.torch_engine.sampling import draw_key

if TYPE_CHECKING:
    from stages.torch_engine.batch_decoder import BatchDecoder
    from stages.torch_engine.sequence import Sequence


class SlotTable:
    def __init__(self, decoder: BatchDecoder) -> None:
        self.decoder = decoder
        self.rows: list[Sequence] = []
        # Rows promised to sequences whose cache is arriving.
        self.promised = 0
        # Sequences given a row so far: the order that says which is youngest.
        self._admitted = 0

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def taken(self) -> int:
        return len(self.rows) + self.promised

    def can_take(self, tokens: int, spare: int = 0, held: list[int] | None = None) -> bool:
        """Whether a sequence holding ``tokens`` positions can join now,
        leaving ``spare`` blocks free (``held``: the blocks it has already,
        a cached prefix's)."""
        n = self.decoder.blocks_for(tokens)
        decoder = self.decoder
        return (
            self.taken < decoder.max_slots
            and n <= decoder.blocks_per_seq
            and decoder.pool.can_allocate(n + spare - len(held or []))
        )

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
        """``seq``'s row (if any) and blocks go back (and any copy swapped out)."""
        self._leave(seq)
        self.decoder.pool.free(seq.blocks)
        seq.blocks = []
        seq.swapped = None

    def swap_out(self, seq: Sequence) -> None:
        """Preempt ``seq``: its cache to host memory, its row and blocks back."""
        swapped = self.decoder.to_host(seq.blocks)
        self.free(seq)
        seq.swapped = swapped

    def can_swap_in(self, seq: Sequence) -> bool:
        n = len(seq.swapped[0][0]) if seq.swapped else 0
        return self.taken < self.decoder.max_slots and self.decoder.pool.can_allocate(n)

    def swap_in(self, seq: Sequence) -> int:
        """A swapped-out sequence back in blocks and a row, as it was."""
        assert seq.swapped is not None
        seq.blocks = self.decoder.pool.allocate(len(seq.swapped[0][0]))
        self.decoder.from_host(seq.blocks, seq.swapped)
        seq.swapped = None
        return self._place(seq)

    def grow(self, seqs: list[Sequence]) -> list[Sequence]:
        """A block for each row's next write where it has none, oldest first;
        where the pool has none left, the youngest of ``seqs`` is swapped out
        (it may be the one growing). Returns those swapped out."""
        pool, size = self.decoder.pool, self.decoder.block_size
        preempted: list[Sequence] = []
        for seq in sorted(seqs, key=lambda q: q.admitted):
            while seq.slot >= 0 and len(seq.blocks) <= seq.ahead // size:
                if pool.can_allocate(1):
                    seq.blocks += pool.allocate(1)
                    continue
                victim = max((q for q in seqs if q.slot >= 0), key=lambda q: q.admitted)
                self.swap_out(victim)
                preempted.append(victim)
        return preempted

    def leak(self, seq: Sequence) -> None:
        """As ``free``, but its blocks stay out of use for good (a READ may still write them)."""
        self._leave(seq)
        seq.blocks = []

    def _allocate(self, seq: Sequence, tokens: int) -> None:
        """Blocks for ``tokens`` positions after those ``seq`` holds (a cached prefix's)."""
        if not self.can_take(tokens, held=seq.blocks):
            raise RuntimeError("no decoder row or KV blocks free")
        seq.blocks = seq.blocks + self.decoder.pool.allocate(self.decoder.blocks_for(tokens) - len(seq.blocks))

    def _place(self, seq: Sequence) -> int:
        if len(self.rows) >= self.decoder.max_slots:
            raise RuntimeError("no free decoder row")
        row = len(self.rows)
        self.rows.append(seq)
        seq.slot = row
        if not seq.admitted:
            self._admitted += 1
            seq.admitted = self._admitted
        self.decoder.set_table(row, seq.blocks)
        # Its generated tokens that no step will feed: all but the last (fed
        # by its next step), or all while the last is still on its way (pending).
        self.decoder.set_sampling(row, seq.sampling, seq.output_ids[:-1] if seq.pending is None else seq.output_ids)
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
        inputs = StepInputs([], [], [], [], [], [], [], [], [])
        size = self.decoder.block_size
        for row, seq in enumerate(self.rows):
            # A prefill token still on its way to the host (prefill(defer=True)) is not in
            # output_ids yet, and its prompt fills the cache: a step it takes no part in
            # writes past it (not over the prompt's last position).
            # (A prefill's token fed from its cell on the device writes its key and value where its first step will.)
            settled, ahead, generated = seq.pending is None, seq.ahead, seq.generated_ahead
            # A row not asked (nor grown) past its blocks writes where its table says: the null block.
            index = ahead // size
            inputs.block.append(seq.blocks[index] if index < len(seq.blocks) else -1)
            fed = seq.feed_row >= 0
            inputs.tokens.append(seq.output_ids[-1] if settled and not fed else 0)
            inputs.positions.append(ahead + seq.rope_delta)
            inputs.write_at.append(ahead)
            inputs.feed.append(seq.feed_row if fed else -1)
            inputs.mask_eos.append(int(generated < seq.sampling.min_tokens))
            inputs.asked.append(int(asked is None or row in asked))
            sampling = seq.sampling
            inputs.draws.append(0 if sampling.greedy else draw_key(sampling.seed, generated))
            inputs.lora.append(seq.lora)
        return inputs
