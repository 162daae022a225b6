"""Structured output in the built-in engine: each structured sequence's
grammar matcher, and its allowed tokens as a mask on the step's logits
(xgrammar's bitmask, applied to the rows that ask for one in one call)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from schemas.request import StructuredOutput
from stages import structured


@dataclass(eq=False)
class GrammarState:
    """A sequence's matcher, and how many of its output tokens it has taken."""

    matcher: Any
    accepted: int = 0

    def catch_up(self, output_ids: list[int]) -> None:
        """Advance over the tokens chosen since the last mask, including
        those a sequence starts with (a takeover's, a prefill worker's)."""
        for token in output_ids[self.accepted :]:
            if self.matcher.is_terminated():
                break  # ignore_eos: what follows the answer's end is not the grammar's
            if not self.matcher.accept_token(token):
                raise ValueError(f"token {token} at index {self.accepted} is not allowed by the request's grammar")
            self.accepted += 1
        self.accepted = len(output_ids)


class Grammars:
    """One engine's grammar compiler (its tokenizer's vocabulary, compiled
    grammars cached by xgrammar) and its masks."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=True)
        self.vocab_size = vocab_size

    def state(self, spec: StructuredOutput) -> GrammarState:
        compiled = self._compiler.compile_grammar(structured.grammar(spec))
        return GrammarState(self._xgr.GrammarMatcher(compiled))

    def mask(self, logits: torch.Tensor, rows: Sequence[tuple[GrammarState, list[int], int]]) -> None:
        """Set to -inf, in place, the tokens each row's grammar does not allow
        next: ``rows`` are (state, the sequence's output ids, row of ``logits``)."""
        bitmask = self._xgr.allocate_token_bitmask(logits.shape[0], self.vocab_size)
        indices = []
        for state, output_ids, row in rows:
            state.catch_up(output_ids)
            if not state.matcher.is_terminated():
                state.matcher.fill_next_token_bitmask(bitmask, row)
                indices.append(row)
        if indices:
            bitmask = bitmask.to(logits.device, non_blocking=True)
            self._xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=indices)
