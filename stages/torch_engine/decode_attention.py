"""Decode attention over the batch decoder's paged cache, for the fused
step: what a step computes once for every layer (``StepAttention``) and the
masked forms (each row's blocks gathered into a span under a length mask:
SDPA, or grouped matmuls). The Triton kernel, which reads each row's own
blocks through its table and nothing more, is
stages/torch_engine/kernels/triton_decode.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class StepAttention:
    """What attention needs of one step, computed once for every layer.

    ``table`` [bucket, blocks]: each row's block table (the masked forms:
    the span's blocks only). ``mask`` [bucket, span]: where each row's
    prefix is (the masked kernels read ``span`` positions of every row).
    ``lengths``, ``counters``: the Triton kernel's."""

    bucket: int
    span: int
    table: torch.Tensor
    mask: torch.Tensor | None = None
    lengths: torch.Tensor | None = None
    counters: torch.Tensor | None = None


def length_mask(bucket: int, span: int, write_at: torch.Tensor) -> torch.Tensor:
    """[bucket, span]: row r reads positions 0..write_at[r] (its prefix and the token written now)."""
    return torch.arange(span, device=write_at.device)[None, :] <= write_at[:bucket, None]


def masked_step(bucket: int, span: int, write_at: torch.Tensor, table: torch.Tensor) -> StepAttention:
    return StepAttention(bucket, span, table, mask=length_mask(bucket, span, write_at))


def rows_step(
    bucket: int, write_at: torch.Tensor, table: torch.Tensor, counters: torch.Tensor | None = None
) -> StepAttention:
    """Row r reads its first write_at[r] + 1 positions (the Triton kernel's form)."""
    return StepAttention(bucket, 0, table, lengths=write_at[:bucket] + 1, counters=counters)


def gather_blocks(pool: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """A layer's pool [blocks, kv_heads, block_size, d] read through ``table``
    [b, n] → [b, kv_heads, n * block_size, d]: each row's positions in order."""
    b, n = table.shape
    _, kv_heads, block_size, d = pool.shape
    return pool[table].transpose(1, 2).reshape(b, kv_heads, n * block_size, d)


def attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scaling: float
) -> torch.Tensor:
    """q [b, heads, d] over keys, values [b, kv_heads, span, d] where mask [b, span]; → [b, heads * d]."""
    b, heads, d = q.shape
    kv_heads = keys.shape[1]
    grouped = q.view(b, kv_heads, heads // kv_heads, d)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * scaling  # [b, kv, groups, span]
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, values).reshape(b, heads * d)


def attend_sdpa(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scaling: float
) -> torch.Tensor:
    """``attend`` by torch's fused attention kernels (one launch where a backend takes the mask)."""
    b, heads, d = q.shape
    gqa = keys.shape[1] != heads
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], keys, values, attn_mask=mask[:, None, None, :], scale=scaling, enable_gqa=gqa
    )
    return out.reshape(b, heads * d)
