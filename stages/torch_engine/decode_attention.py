"""Decode attention over the batch decoder's cache, for the fused step:
what a step computes once for every layer (``StepAttention``), the masked
forms (a span of every slot under a length mask: SDPA, or grouped matmuls)
and flash-attention's varlen kernel over the cache as it lies, with its
contract in plain torch for tests. The Triton kernels are
stages/torch_engine/kernels/triton_decode.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class StepAttention:
    """What attention needs of one step, computed once for every layer.

    ``mask`` [bucket, span]: where each row's prefix is (the masked kernels
    read ``span`` positions of every slot). ``seq_used``, ``cu_q``,
    ``cu_k``: the varlen form, one sequence per (row, kv head) reading only
    its own ``seq_used`` keys."""

    bucket: int
    span: int
    mask: torch.Tensor | None = None
    seq_used: torch.Tensor | None = None
    cu_q: torch.Tensor | None = None
    cu_k: torch.Tensor | None = None
    lengths: torch.Tensor | None = None
    counters: torch.Tensor | None = None  # the Triton kernel's (triton_decode.attend)


def length_mask(bucket: int, span: int, write_at: torch.Tensor) -> torch.Tensor:
    """[bucket, span]: row r reads positions 0..write_at[r] (its prefix and the token written now)."""
    return torch.arange(span, device=write_at.device)[None, :] <= write_at[:bucket, None]


def masked_step(bucket: int, span: int, write_at: torch.Tensor) -> StepAttention:
    return StepAttention(bucket, span, mask=length_mask(bucket, span, write_at))


def rows_step(bucket: int, write_at: torch.Tensor, counters: torch.Tensor | None = None) -> StepAttention:
    """Row r reads its first write_at[r] + 1 positions (the Triton kernel's form)."""
    return StepAttention(bucket, 0, lengths=write_at[:bucket] + 1, counters=counters)


def varlen_step(bucket: int, write_at: torch.Tensor, kv_heads: int, max_len: int) -> StepAttention:
    """Row r's kv head h is sequence r * kv_heads + h, its keys at (that) *
    max_len in a layer's flattened cache, write_at[r] + 1 of them."""
    seq_used = (write_at[:bucket] + 1).to(torch.int32).repeat_interleave(kv_heads)
    starts = torch.arange(bucket * kv_heads + 1, dtype=torch.int32, device=write_at.device)
    return StepAttention(bucket, 0, seq_used=seq_used, cu_q=starts, cu_k=starts * max_len)


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


# (q [total_q, heads, d], k, v [total_k, kv_heads, d], cu_q, cu_k, max_q, max_k, seq_used, scale) → out like q
Varlen = Callable[..., torch.Tensor]


def flash_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    seq_used: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """torch's flash-attention 2 varlen forward, keys of sequence i read from
    ``cu_k[i]`` for ``seq_used[i]`` positions (half precision on CUDA)."""
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, False, False, scale=scale, seqused_k=seq_used
    )
    return out[0]


def varlen_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    seq_used: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``flash_varlen``'s contract in plain torch, sequence by sequence (any
    device and dtype): what tests hold the packing against."""
    out = torch.empty_like(q)
    groups = q.shape[1] // k.shape[1]
    for i in range(cu_q.numel() - 1):
        qs = q[int(cu_q[i]) : int(cu_q[i + 1])].transpose(0, 1)  # [heads, n, d]
        start = int(cu_k[i])
        ks = k[start : start + int(seq_used[i])].transpose(0, 1).repeat_interleave(groups, 0)
        vs = v[start : start + int(seq_used[i])].transpose(0, 1).repeat_interleave(groups, 0)
        probs = torch.softmax((qs @ ks.transpose(-1, -2)).float() * scale, dim=-1).to(q.dtype)
        out[int(cu_q[i]) : int(cu_q[i + 1])] = (probs @ vs).transpose(0, 1)
    return out


def attend_varlen(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, step: StepAttention, scaling: float, varlen: Varlen
) -> torch.Tensor:
    """q [b, heads, d] over a layer's whole cache keys, values [slots,
    kv_heads, len, d]: each (row, kv head) is a sequence of one query token
    for each head of its group, over its own ``seq_used`` keys, which lie
    contiguous in the cache at ((row * kv_heads + h) * len). Nothing is
    copied, padding positions are never read, and the step's span does not
    matter (one CUDA graph per batch size).

    One token per sequence, not the group's heads as a sequence's tokens:
    flash-attention does that swap itself for one query token, and then
    splits the keys across thread blocks (H100, Qwen2-VL-2B shapes, 32
    rows: 13.6 against 14.3 us a layer)."""
    assert step.seq_used is not None and step.cu_q is not None and step.cu_k is not None
    b, heads, d = q.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    flat_k = keys[:b].view(b * kv_heads * length, 1, d)
    flat_v = values[:b].view(b * kv_heads * length, 1, d)
    grouped = q.reshape(b * kv_heads, heads // kv_heads, d)  # heads are kv-major
    out = varlen(grouped, flat_k, flat_v, step.cu_q, step.cu_k, 1, length, step.seq_used, scaling)
    return out.reshape(b, heads * d)
