"""Decode attention over the batch decoder's paged cache, as one Triton kernel.

One query token per row, grouped-query: the heads of a kv head's group are
the rows of one small matrix, so each key and value is read once per kv
head, not once per query head. A row's keys are dealt out in blocks to a
few programs (flash-decoding), each leaving its partial output and
log-sum-exp; the last of them to finish combines the partials (a counter
per (row, kv head), which that program resets), so a layer's attention is
one kernel, not a split kernel and a combine kernel (in a CUDA graph each
kernel also costs its gap before the next). A row reads its own length
through its block table (a layer's pool is [blocks, kv_heads, block_size,
head_dim]: each position's block looked up, a head's positions within a
block contiguous, so loads stay coalesced along head_dim) and nothing past
it; the grid depends on the batch size only (not on the rows' lengths), so
a CUDA graph serves any length.

Why not flash-attention's kernel: on an H100, Qwen2-VL-2B shapes, 32 rows
of ~360 tokens, its split-KV kernel and combine take 13.6 us a layer for
~6 MB of keys and values, and a step with it is 0.07-0.25 ms slower than
with these (README, Benchmarks).

Triton is imported when the kernels are first built (CUDA hosts have it
with torch).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

BLOCK_N = 64  # keys a program reads at a time
TARGET_PROGRAMS = 512  # a few per SM of an H100 (132)


def supported(head_dim: int) -> bool:
    """tl.arange wants a power of two, tl.dot 16 at least."""
    return 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0


def programs_per_row(rows: int, kv_heads: int) -> int:
    """Programs that share one (row, kv head)'s keys, block i to program i
    mod this: enough in all to fill the card at a small batch, few enough
    that the ones past a short row's length (they read its length and
    stop) cost little; independent of the slot's size."""
    return max(2, min(32, TARGET_PROGRAMS // (rows * kv_heads)))


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    lengths: torch.Tensor,
    table: torch.Tensor,
    scaling: float,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [b, heads, d] over a layer's pool keys, values [blocks, kv_heads,
    block_size, d], row r reading its first lengths[r] positions through
    its block table table[r]; → [b, heads * d].
    ``counters``: int32 zeros, b * kv_heads at least, left zero again (a
    decoder keeps one for all its steps and layers; fresh ones if None)."""
    b, heads, d = q.shape
    kv_heads, block_size = keys.shape[1], keys.shape[2]
    groups = heads // kv_heads
    groups_p = max(16, 1 << (groups - 1).bit_length())  # tl.dot wants 16 rows at least
    programs = programs_per_row(b, kv_heads)
    if counters is None:
        counters = torch.zeros(b * kv_heads, dtype=torch.int32, device=q.device)
    elif counters.numel() < b * kv_heads or counters.dtype != torch.int32:
        raise ValueError(f"counters: int32, {b * kv_heads} at least")
    partial = torch.empty((b, kv_heads, programs, groups_p, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((b, kv_heads, programs, groups_p), dtype=torch.float32, device=q.device)
    q = q.contiguous()
    out = torch.empty_like(q)
    _kernel()[(b, kv_heads, programs)](
        q, keys, values, lengths, table, partial, lse, out, counters, scaling,
        q.stride(0), q.stride(1), table.stride(0),
        keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        partial.stride(0), partial.stride(1), partial.stride(2), partial.stride(3),
        lse.stride(0), lse.stride(1), lse.stride(2),
        out.stride(0), out.stride(1),
        GROUPS=groups, GROUPS_P=groups_p, D=d, BLOCK_N=BLOCK_N, PAGE=block_size,
        num_warps=4, num_stages=2,
    )  # fmt: skip
    return out.reshape(b, heads * d)


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def decode_attention(  # type: ignore[no-untyped-def]  # Triton reads annotations as types
        Q, K, V, Lengths, Table, Partial, Lse, Out, Counters, scale,
        sqb, sqh, stb, skb, skh, skn, svb, svh, svn, spb, sph, sps, spg, slb, slh, sls, sob, soh,
        GROUPS: tl.constexpr, GROUPS_P: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
        PAGE: tl.constexpr,
    ):  # fmt: skip
        # 64-bit offsets: a block's stride times the pool's blocks passes 2**31.
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        s = tl.program_id(2)
        programs = tl.num_programs(2)
        length = tl.load(Lengths + b).to(tl.int32)
        start = s * BLOCK_N
        g = tl.arange(0, GROUPS_P)
        d = tl.arange(0, D)
        rows = g < GROUPS
        q = tl.load(Q + b * sqb + (h * GROUPS + g)[:, None] * sqh + d[None, :], mask=rows[:, None], other=0.0)
        m = tl.full([GROUPS_P], float("-inf"), tl.float32)
        total = tl.zeros([GROUPS_P], tl.float32)
        acc = tl.zeros([GROUPS_P, D], tl.float32)
        table = Table + b * stb
        for n0 in range(start, length, programs * BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            live = n < length
            block = tl.load(table + n // PAGE, mask=live, other=0).to(tl.int64)
            within = n % PAGE
            k_rows = K + block * skb + h * skh + within * skn
            v_rows = V + block * svb + h * svh + within * svn
            k = tl.load(k_rows[:, None] + d[None, :], mask=live[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k)) * scale
            scores = tl.where(live[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m - m_new)
            total = total * alpha + tl.sum(p, 1)
            v = tl.load(v_rows[:, None] + d[None, :], mask=live[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        # A program past the row's length read nothing and writes nothing: the combine stops before it.
        # A tensor, not a scalar, beside ``rows``: Triton's CPU interpreter takes no other mask.
        live = rows & ((g * 0 + start) < length)
        safe = tl.where(total > 0, total, 1.0)
        partial_base = Partial + b * spb + h * sph
        lse_base = Lse + b * slb + h * slh + g
        tl.store(
            partial_base + s * sps + g[:, None] * spg + d[None, :],
            acc / safe[:, None],
            mask=live[:, None],
        )
        tl.store(lse_base + s * sls, m + tl.log(safe), mask=live)

        # Every program counts itself in, after its stores (the atomic releases
        # them); the last one in (it acquires them all) combines, in program
        # order whoever it is, and leaves the counter at zero for the next launch.
        counter = Counters + b * tl.num_programs(1) + h
        if tl.atomic_add(counter, 1, sem="acq_rel") == programs - 1:
            tl.store(counter, 0)
            used = tl.minimum(programs, tl.cdiv(length, BLOCK_N))
            top = tl.full([GROUPS_P], float("-inf"), tl.float32)
            for i in range(0, used):
                top = tl.maximum(top, tl.load(lse_base + i * sls, mask=rows, other=0.0, cache_modifier=".cg"))
            weight = tl.zeros([GROUPS_P], tl.float32)
            out = tl.zeros([GROUPS_P, D], tl.float32)
            for i in range(0, used):
                w = tl.exp(tl.load(lse_base + i * sls, mask=rows, other=0.0, cache_modifier=".cg") - top)
                part = tl.load(
                    partial_base + i * sps + g[:, None] * spg + d[None, :],
                    mask=rows[:, None],
                    other=0.0,
                    cache_modifier=".cg",
                )
                out += w[:, None] * part
                weight += w
            out = out / tl.where(rows, weight, 1.0)[:, None]
            tl.store(
                Out + b * sob + (h * GROUPS + g)[:, None] * soh + d[None, :],
                out.to(Out.dtype.element_ty),
                mask=rows[:, None],
            )

    return decode_attention
