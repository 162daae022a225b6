"""A chat prompt's token ids, one segment at a time, the long ones remembered.

Every turn of a conversation sends its whole history again, and the
processor renders and tokenizes all of it before the request is queued:
for a 3,000-token conversation about 3 ms of one core on an idle machine
(the built-in Qwen tokenizer) and about 10 under load (2 vCPUs, eight
users, four workers), on every turn's way to its first token, while the
prefix cache makes the rest of a later turn nearly free.

A fast tokenizer splits its input at its special tokens before anything
else (they are matched in the raw text, never normalized) and then
normalizes, pre-tokenizes and encodes each piece between them on its own:
so the ids of the whole are the ids of the pieces and of the special
tokens, in order. A chat template puts a special token around every
message, and most of a later turn's pieces are the earlier turns' own:
each piece's ids are kept (LRU, bounded by characters) and only the
new pieces are encoded, in one call. Special tokens that strip the spaces
beside them, match whole words only or are matched after normalization
would make a piece depend on its neighbours: they do not split here (a
piece holding one is encoded whole, as the tokenizer would).
"""

from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict
from typing import Any

# What a piece kept takes of the bound at least, in characters: the short
# ones too are kept (a chat template's own, between its special tokens,
# come in every request: after the idle between one client's requests one
# took 70 to 130 µs to encode against 5 to look up, 2 vCPUs), and many
# short ones must not hold more memory than the bound means.
MIN_ENTRY_CHARS = 64
# New pieces of fewer characters than this, all together, are encoded one
# after another on the calling thread: ``encode_batch`` hands them to its
# thread pool, whose threads, asleep between one client's requests, cost
# more to wake than they save. After 8 ms idle, the five pieces of a short
# chat took 315 to 410 µs batched against 224 to 258 one by one; four of
# 1,000 characters about even (2.45 against 2.31 to 2.39 ms); four of
# 4,000 4.8 to 5.6 against 8.1 (2 vCPUs, the built-in Qwen tokenizer).
SERIAL_CHARS = 4096


class SegmentTokenizer:
    """``tokenizer(text, add_special_tokens=False)["input_ids"]``, exactly,
    with the pieces between special tokens remembered. Thread-safe."""

    def __init__(self, tokenizer: Any, max_chars: int = 16 << 20, serial_chars: int = SERIAL_CHARS) -> None:
        self._tokenizer = tokenizer
        self._backend: Any = getattr(tokenizer, "backend_tokenizer", None)
        self.max_chars = max_chars
        self.serial_chars = serial_chars
        self._special: dict[str, int] = {}
        if self._backend is not None and not getattr(tokenizer, "split_special_tokens", False):
            for token_id, token in getattr(tokenizer, "added_tokens_decoder", {}).items():
                if token.special and not (token.lstrip or token.rstrip or token.single_word or token.normalized):
                    self._special[str(token.content)] = int(token_id)
        # Longest first: the tokenizer matches the leftmost, longest special token.
        alternatives = sorted(self._special, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")") if alternatives else None
        # Ids as 4-byte arrays: 16M characters (about 4M tokens) keep 16 MB of ids, not 140 of ints.
        self._kept: OrderedDict[str, array[int]] = OrderedDict()
        self._kept_chars = 0
        self._lock = threading.Lock()
        # Characters of long pieces found remembered, and encoded.
        self.hit_chars = 0
        self.miss_chars = 0

    def __call__(self, text: str) -> list[int]:
        if self._split is None:
            return [int(t) for t in self._tokenizer(text, add_special_tokens=False)["input_ids"]]
        pieces = self._split.split(text)  # text, special, text, ..., text
        found: dict[str, array[int]] = {}
        with self._lock:
            for piece in pieces[::2]:
                if piece not in found and (ids := self._kept.get(piece)) is not None:
                    self._kept.move_to_end(piece)
                    found[piece] = ids
                    self.hit_chars += len(piece)
        new = list(dict.fromkeys(p for p in pieces[::2] if p and p not in found))
        if new:
            if sum(map(len, new)) < self.serial_chars:
                encoded = [self._backend.encode(piece, add_special_tokens=False) for piece in new]
            else:
                encoded = self._backend.encode_batch(new, add_special_tokens=False)
            found.update((piece, array("i", e.ids)) for piece, e in zip(new, encoded, strict=True))
            self._keep(new, found)
        out: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2:
                out.append(self._special[piece])
            elif piece:
                out.extend(found[piece])
        return out

    def _keep(self, pieces: list[str], found: dict[str, array[int]]) -> None:
        with self._lock:
            for piece in pieces:
                self.miss_chars += len(piece)
                if len(piece) > self.max_chars or piece in self._kept:
                    continue
                self._kept[piece] = found[piece]
                self._kept_chars += _entry_chars(piece)
                while self._kept_chars > self.max_chars:
                    gone, _ = self._kept.popitem(last=False)
                    self._kept_chars -= _entry_chars(gone)

    @property
    def kept_chars(self) -> int:
        return self._kept_chars


def _entry_chars(piece: str) -> int:
    return max(len(piece), MIN_ENTRY_CHARS)
