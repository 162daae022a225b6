"""Streaming detokenization that never splits a multi-byte character, and
stop strings that never leak a prefix of themselves."""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Turns tokens into text deltas.

    Decoding a token alone is wrong for byte-level BPE: one character may span
    several tokens. Each step decodes a short window ending at the newest token
    and emits what the window adds; a delta ending in U+FFFD (an incomplete
    character) is held back until the next token completes it.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=self._skip_special))

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return delta

    def flush(self) -> str:
        """Whatever is held back, complete or not: the stream is over."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]


class StopStringMatcher:
    """Holds back the tail of the text that could still become a stop string."""

    def __init__(self, stops: list[str]) -> None:
        self._stops = [s for s in stops if s]
        self._holdback = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """Text safe to emit now, and whether a stop string was reached (the
        stop string itself is not emitted)."""
        self._pending += delta
        if self._stops:
            hits = [i for i in (self._pending.find(s) for s in self._stops) if i >= 0]
            if hits:
                text = self._pending[: min(hits)]
                self._pending = ""
                return text, True
        if len(self._pending) <= self._holdback:
            return "", False
        cut = len(self._pending) - self._holdback
        text, self._pending = self._pending[:cut], self._pending[cut:]
        return text, False

    def flush(self) -> str:
        text, self._pending = self._pending, ""
        return text
