"""Content keys of a prompt's full KV blocks, for prefix caching.

A block's keys and values depend on every token up to its last and on
what each media placeholder among them shows, so a block's key folds in
its parent's key, its own token ids and the content digest of each media
item whose placeholder tokens it covers (with where in the item it
starts): two prompts share a block only where their tokens and their
media bytes are equal, never by a URL. A salt (a tenant's, later a LoRA
adapter's) goes into the first block's key, and so into every key after.
Only full blocks get a key: a block still filling has no content to share.

Keys are 64-bit unsigned integers (the first eight bytes of a SHA-256),
the form vLLM's KV events carry block hashes in.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NamedTuple

import msgspec


class MediaSpan(NamedTuple):
    """A media item's placeholder tokens in the expanded prompt, and its content digest."""

    start: int
    length: int
    digest: str


def block_keys(
    token_ids: Sequence[int],
    block_size: int,
    media: Sequence[MediaSpan] = (),
    salt: str | None = None,
) -> list[int]:
    """The key of each full block of ``token_ids``, in order."""
    keys: list[int] = []
    parent: int | str | None = salt
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        end = start + block_size
        shown = [(m.digest, start - m.start) for m in media if m.start < end and start < m.start + m.length]
        key = block_key(parent, token_ids[start:end], shown)
        keys.append(key)
        parent = key
    return keys


def block_key(parent: int | str | None, tokens: Sequence[int], shown: Sequence[tuple[str, int]] = ()) -> int:
    """One block's key: its parent's key (or the salt, or None), its tokens,
    and (digest, offset in the item) of each media item it shows."""
    payload = msgspec.msgpack.encode((parent, list(tokens), list(shown)))
    return int.from_bytes(hashlib.sha256(payload).digest()[:8], "little")


class PromptMedia(NamedTuple):
    """A media item of an unexpanded prompt: the index of its one placeholder
    token, how many tokens it expands to (None: not known) and its digest
    (empty: not known)."""

    placeholder_index: int
    num_tokens: int | None
    digest: str


def prompt_block_keys(prompt: Sequence[int], media: Sequence[PromptMedia], block_size: int) -> list[int]:
    """The keys an engine gives the full blocks of ``prompt`` once each
    media placeholder is expanded (repeated ``num_tokens`` times, as the
    families expand them), up to the first item whose token count or
    content is not known: its blocks could not be told from another's."""
    ids, spans, whole = expand(prompt, media)
    if not whole:
        ids = ids[: len(ids) - len(ids) % block_size]
    return block_keys(ids, block_size, spans)


def expand(prompt: Sequence[int], media: Sequence[PromptMedia]) -> tuple[list[int], list[MediaSpan], bool]:
    """The prompt's ids with each placeholder expanded and the media's
    spans in them, up to the first item whose token count or content is not
    known (then False: what follows is cut off)."""
    ids: list[int] = []
    spans: list[MediaSpan] = []
    at = 0
    for m in sorted(media, key=lambda m: m.placeholder_index):
        ids.extend(prompt[at : m.placeholder_index])
        if m.num_tokens is None or not m.digest:
            return ids, spans, False
        spans.append(MediaSpan(len(ids), m.num_tokens, m.digest))
        ids.extend([prompt[m.placeholder_index]] * m.num_tokens)
        at = m.placeholder_index + 1
    ids.extend(prompt[at:])
    return ids, spans, True
