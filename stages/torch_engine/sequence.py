"""A sequence's state between engine calls, a launched step, and what
travels with a KV cache to another engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stages.sampling import Logprobs, SamplingConfig
from stages.torch_engine.batch_decoder import Launched
from stages.torch_engine.grammar import GrammarState


@dataclass(eq=False)
class Sequence:
    """Per-request state between engine calls.

    The prompt itself is not kept: decoding needs only its length (positions)
    and the tokens generated since, so a decode worker can hold a sequence it
    received as KV cache without the prompt ids.
    """

    prompt_len: int  # expanded: each media placeholder counted as its tokens
    output_ids: list[int]  # generated so far; the last one is not yet in the cache
    sampling: SamplingConfig
    rope_delta: int
    cache: Any  # transformers Cache until the batch decoder takes it; None after
    # Row of the batch decoder's steps once admitted there; -1 otherwise.
    slot: int = -1
    # Its blocks of the batch decoder's KV pool (its block table), in order.
    blocks: list[int] = field(default_factory=list)
    # Its blocks are being written by a KV transfer (reserve_kv): no row, no step yet.
    receiving: bool = False
    # The CUDA event such a transfer waits for before it writes (TorchEngine.wait_quiet).
    quiet: Any = None
    # Preempted: its cache in host memory, per layer (keys, values) of its
    # blocks, until blocks are free again (SlotTable.swap_in).
    swapped: Any = None
    # Its place in the order sequences first took a row (the youngest is preempted first).
    admitted: int = 0
    # Steps launched for it whose tokens are not collected yet (``launch``),
    # and the decoder row its last launched token waits in on the device.
    inflight: int = 0
    feed_row: int = -1
    # Its next token, chosen on the device and on its way to the host
    # (``prefill(defer=True)``); ``TorchEngine.settle`` appends it.
    pending: Launched | None = None
    # Prefix caching: the content keys of its prompt's full blocks, until its
    # blocks hold them (then registered in the pool), and the prompt tokens
    # whose blocks came from the cache instead of a prefill.
    prefix_keys: list[int] = field(default_factory=list)
    # The expanded prompt's ids those keys cover (and more), for the KV events.
    prefix_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    # Where the sampling asks for logprobs: each generated token's, by its index.
    logprobs: dict[int, Logprobs] = field(default_factory=dict)
    # The logits its prompt's prefill gave, until its first step, or while
    # ``forkable`` (choices of the same prompt may still fork from it:
    # TorchEngine.fork); then None.
    prompt_logits: Any = None
    forkable: bool = False
    # Structured output: its grammar's matcher (made at its first mask).
    grammar: GrammarState | None = None
    # Its LoRA adapter (stages/torch_engine/lora.py): the name it was asked
    # by, and the adapter's slot in the engine's stacks (0: none).
    lora_name: str | None = None
    lora: int = 0

    @property
    def length(self) -> int:
        return self.prompt_len + len(self.output_ids)

    @property
    def num_generated(self) -> int:
        return len(self.output_ids)

    @property
    def ahead(self) -> int:
        """Where its next step writes: the positions its cache holds, and
        those of steps launched for it. (Its last token is not in the cache
        yet, unless it is a prefill's token on its way to the host, not yet
        in ``output_ids``.) Read with ``pending`` settled or not, never as
        it settles: the engine's settle lock."""
        return self.length - (self.pending is None) + self.inflight

    @property
    def generated_ahead(self) -> int:
        """Tokens generated, a pending one and those of launched steps counted."""
        return self.num_generated + (self.pending is not None) + self.inflight

    @property
    def output_token_ids(self) -> list[int]:
        return self.output_ids

    @property
    def reached_max_tokens(self) -> bool:
        return self.num_generated >= self.sampling.max_tokens

    @property
    def released(self) -> bool:
        return self.cache is None and self.slot < 0 and not self.blocks and self.swapped is None


@dataclass(frozen=True)
class Launch:
    """A launched step: the sequences asked for with their rows (-1: not in
    the step, waiting for blocks), and the device step. ``carried``: whether
    it ran the chunk of a long prompt it was given; ``chunk``: what that
    gave (as ``TorchEngine.prefill_chunk``: None before its last chunk), or
    the error that ended that prompt."""

    rows: list[tuple[Sequence, int]]
    # None: no sequence of the step had a row (every one waits for blocks).
    launched: Launched | None
    carried: bool = False
    chunk: Any = None

    @property
    def stepped(self) -> list[bool]:
        return [row >= 0 for _, row in self.rows]


@dataclass(frozen=True)
class KvState:
    """What travels with a sequence's KV cache to another engine: enough to
    rebuild the sequence there (the per-layer tensors travel beside it, in
    blocks: [blocks, kv_heads, block_size, head_dim] each)."""

    prompt_len: int
    output_ids: list[int]
    rope_delta: int
