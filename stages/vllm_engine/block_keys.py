"""vLLM's block hashes as mmpipe's block keys, for mmpipe's KV router.

vLLM keys a cached block by a hash of its parent's, its tokens and its
media's vLLM hashes, with a hash function and seed of its own: a router
that computes mmpipe's keys of a prompt (stages/prefix_keys.py) never finds
them. The worker that gave vLLM the prompt knows mmpipe's key of each of
its blocks, so it rewrites the events it relays: each block vLLM stores is
looked up by its parent (as rewritten) and its tokens among the blocks of
the prompts the worker sent, and gets their key. A block of text alone
that no prompt here explains (a decode worker's, whose prompts came by the
KV connector) is keyed from its parent and tokens directly; one showing
media no prompt here explains ends its run: its key could not tell one
image from another of the same size.

Two prompts sent here whose tokens agree up to and through a block but
whose media differ (two images of one size after the same text) give that
block one content here: the prompt learned last names it. vLLM stores a
prompt's blocks right after its prefill, so that is the prompt the block
came from unless two such prompts prefill at once; then the router may be
told the wrong one of two images is cached (a worse choice, never a wrong
answer: the engine's own cache decides what it reuses).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import msgspec

from schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from stages.prefix_keys import MediaSpan, PromptMedia, block_key, block_keys, expand

# (parent key, tokens) entries kept per block size: a few hundred prompts of a few thousand tokens.
_MAX_BLOCKS = 1 << 17
# Prompts kept to key blocks of a size not seen yet.
_MAX_PROMPTS = 512
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)

Content = tuple[int | None, tuple[int, ...]]
Event = BlockStored | BlockRemoved | AllBlocksCleared


class VllmBlockKeys:
    def __init__(self, max_blocks: int = _MAX_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self._prompts: collections.deque[tuple[list[int], list[MediaSpan]]] = collections.deque(maxlen=_MAX_PROMPTS)
        self._tables: dict[int, collections.OrderedDict[Content, int]] = {}
        # vLLM's hash of a block → mmpipe's key, for the blocks rewritten and not removed.
        self._ours: collections.OrderedDict[int, int] = collections.OrderedDict()
        self.placeholders: set[int] = set()
        self.unexplained = 0

    def learn(self, prompt: Sequence[int], media: Sequence[PromptMedia]) -> None:
        """A prompt this worker gives vLLM: the keys of its blocks, for each block size in use."""
        self.placeholders.update(prompt[m.placeholder_index] for m in media)
        ids, spans, _ = expand(prompt, media)
        self._prompts.append((ids, spans))
        for size, table in self._tables.items():
            self._add(table, ids, spans, size)

    def rewrite(self, payload: bytes) -> bytes | None:
        """A batch as vLLM published it, with mmpipe's keys (None: nothing left to relay)."""
        batch = _DECODER.decode(payload)
        events = [e for e in (self._event(e) for e in batch.events) if e is not None]
        if not events:
            return None
        return _ENCODER.encode(KVEventBatch(batch.ts, events, batch.data_parallel_rank))

    def _event(self, event: Event) -> Event | None:
        if isinstance(event, BlockStored):
            return self._stored(event)
        if isinstance(event, BlockRemoved):
            keys = [k for k in (self._ours.pop(h, None) for h in event.block_hashes) if k is not None]
            return BlockRemoved(keys, event.medium) if keys else None
        if isinstance(event, AllBlocksCleared):
            self._ours.clear()
        return event

    def _stored(self, event: BlockStored) -> BlockStored | None:
        parent: int | None = None
        if event.parent_block_hash is not None:
            parent = self._ours.get(event.parent_block_hash)
            if parent is None:
                self.unexplained += 1
                return None
        first_parent = parent
        size = event.block_size
        table = self._table(size)
        keys: list[int] = []
        for i, vllm_hash in enumerate(event.block_hashes):
            tokens = tuple(event.token_ids[i * size : (i + 1) * size])
            key = table.get((parent, tokens))
            if key is None:
                if self.placeholders.intersection(tokens):
                    self.unexplained += 1
                    break
                key = block_key(parent, tokens)
            self._ours[vllm_hash] = key
            self._ours.move_to_end(vllm_hash)
            keys.append(key)
            parent = key
        while len(self._ours) > self.max_blocks:
            self._ours.popitem(last=False)
        if not keys:
            return None
        return BlockStored(
            keys,
            first_parent,
            event.token_ids[: len(keys) * size],
            size,
            event.lora_id,
            event.medium,
            event.lora_name,
        )

    def _table(self, size: int) -> collections.OrderedDict[Content, int]:
        table = self._tables.get(size)
        if table is None:
            table = self._tables[size] = collections.OrderedDict()
            for ids, spans in self._prompts:
                self._add(table, ids, spans, size)
        return table

    def _add(
        self, table: collections.OrderedDict[Content, int], ids: list[int], spans: list[MediaSpan], size: int
    ) -> None:
        keys = block_keys(ids, size, spans)
        parent: int | None = None
        for i, key in enumerate(keys):
            content = (parent, tuple(ids[i * size : (i + 1) * size]))
            table[content] = key
            table.move_to_end(content)
            parent = key
        while len(table) > self.max_blocks:
            table.popitem(last=False)
