"""KV cache events on the wire, as vLLM publishes them
(``vllm.distributed.kv_events`` of the vLLM mmpipe runs, 0.32), so that its
example subscriber, NVIDIA Dynamo's ZMQ relay and llm-d's KV indexer can
consume mmpipe's beside vLLM workers' own.

A batch is a msgpack array ``[ts, events, data_parallel_rank]``; each event
a map tagged with its type (``{"type": "BlockStored", ...}``; vLLM before
0.1x sent events as arrays too). Fields with defaults are left out when
unset. Block hashes are the prefix cache's 64-bit block keys (vLLM's
``ExternalBlockHash`` as integers).
"""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the KV cache events."""


class BlockStored(KVCacheEvent):
    """Full blocks now cached, in order: each block's key chains from the one
    before it (``parent_block_hash``: the key before the first; None at a
    prompt's start)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    """Blocks whose content is no longer cached (taken for new content)."""

    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """Every cached block forgotten (a cache reset)."""


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
