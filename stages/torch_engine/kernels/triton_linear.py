"""The decode step's skinny matmuls, y = x @ w.T (+ bias), as one Triton kernel.

At decode a projection's input is a few rows (x [M, K], M the batch, 1..64)
and its weight w [N, K] is megabytes: the work is reading the weight once,
at the card's bandwidth. cuBLAS gets 0.9-2.7 TB/s of an H100's 3.35 at
Qwen2-VL-2B and 7B shapes: small N gives it few tiles, and its split-K
adds a reduce kernel. Here a program streams one [BLOCK_N, K / S] stripe of
the weight (contiguous along K, ``num_stages`` loads in flight) against the
whole batch, S (split-K) chosen so that every SM gets a program. On an H100
in CUDA graphs (python -m pipeline.bench.linear) the kernel takes 3.9 against
cuBLAS's 5.6 us (2B qkv), 11.3 against 13.7 (2B down), 48 against 54 (7B
down), 156 against 177 (2B lm_head); small matrices stay far from the
bandwidth, a launch's fixed microseconds being most of their time.

Split-K is deterministic: each split writes its own float32 partial
([S, M, N]) and the sum is torch's, so that under ``torch.compile`` the
sum, the bias and the cast fuse into the pointwise kernel that consumes the
projection (``skinny_linear``; the op is a ``torch.library.triton_op``, whose
kernel inductor sees).

The kernel is built on first use; registering the op imports Triton where
it imports (CUDA hosts have it with torch). A host without a usable one
still imports this module: ``available()`` is False there.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any

import torch

MAX_M = 64  # rows of x a program holds at once; beyond it the GEMM is no longer skinny
DTYPES = (torch.bfloat16, torch.float16)
MIN_SPLIT_BLOCKS = 3  # BLOCK_K chunks a split reads at least: shorter ones measured slower
MAX_SPLIT = 16


@dataclass(frozen=True)
class Config:
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


@functools.cache
def available() -> bool:
    """Whether Triton imports here (a CPU host may lack it, or hold one that fails to import)."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def block_m(m: int) -> int:
    """x's rows padded to what tl.dot takes (16 at least, a power of two).
    Written as comparisons, not bit tricks, so a symbolic batch size under
    torch.compile guards on three buckets rather than specializing."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


def choose(n: int, k: int, sms: int) -> Config:
    """The fewest splits of K that give every SM a program (gate_up and
    lm_head, with more N tiles than SMs, stay whole), none shorter than
    MIN_SPLIT_BLOCKS chunks. Each split costs an fp32 [M, N] written and
    read back and a pipeline filled once more; an SM without a program
    costs its share of the bandwidth. On an H100 (132 SMs), Qwen2-VL-2B and
    7B shapes, M 1..32 (python -m pipeline.bench.linear), this is the best split
    of 1, 2, 4, 8 or within ~5% of it; splitting further (a few programs
    an SM, to even out the tail) measured slower. The batch size does not
    move the best split there, so it is not an input (nor a guard under
    torch.compile)."""
    base = Config()
    tiles = -(-n // base.block_n)
    blocks = -(-k // base.block_k)
    split = max(1, min(-(-sms // tiles), blocks // MIN_SPLIT_BLOCKS, MAX_SPLIT))
    per_split = -(-blocks // split)
    return replace(base, split_k=-(-blocks // per_split))  # no split past K


@functools.cache
def _sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter's: as an H100, so it runs the splits a GPU would
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def _check(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} @ w {tuple(w.shape)}.T: want x [M, K], w [N, K]")
    if not 1 <= x.shape[0] <= MAX_M:
        raise ValueError(f"x has {x.shape[0]} rows: the skinny kernel takes 1..{MAX_M}")
    if x.dtype != w.dtype or x.dtype not in DTYPES:
        raise ValueError(f"x {x.dtype}, w {w.dtype}: want both bfloat16 or both float16")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("x and w must be contiguous along K")
    if bias is not None and bias.shape != (w.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} for {w.shape[0]} outputs")


def skinny_partials(
    x: torch.Tensor,
    w: torch.Tensor,
    split_k: int | None = None,
    *,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """x [M, K] @ w [N, K].T as float32 partial sums [S, M, N] over S splits
    of K (their sum is the product). Settings left None are ``choose``'s.
    Launches the kernel directly: eager, or Triton's CPU interpreter; under
    torch.compile use ``skinny_linear``."""
    _check(x, w)
    picked = choose(w.shape[0], w.shape[1], _sms(x.device))
    given = {"split_k": split_k, "block_n": block_n, "block_k": block_k}
    given |= {"num_warps": num_warps, "num_stages": num_stages}
    config = replace(picked, **{key: v for key, v in given.items() if v is not None})
    return _launch(_kernel(), x, w, config)


def _launch(kernel: Any, x: torch.Tensor, w: torch.Tensor, config: Config) -> torch.Tensor:
    m, (n, k) = x.shape[0], w.shape
    blocks = -(-k // config.block_k)
    if not 1 <= config.split_k <= blocks:
        raise ValueError(f"split_k {config.split_k}: 1..{blocks} for K {k} in blocks of {config.block_k}")
    per_split = -(-blocks // config.split_k) * config.block_k
    out = torch.empty((config.split_k, m, n), dtype=torch.float32, device=x.device)
    kernel[(-(-n // config.block_n), config.split_k)](
        x, w, out, m, n, k, x.stride(0), w.stride(0), per_split,
        BLOCK_M=block_m(m), BLOCK_N=config.block_n, BLOCK_K=config.block_k, EVEN_K=k % config.block_k == 0,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out


def _op_partials(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The op's body, traced by torch.compile (FakeTensors, symbolic sizes).
    N and K become constants (a projection's weight has one shape, and the
    config is chosen from it); M stays symbolic but for block_m's buckets."""
    _check(x, w)
    n, k = int(w.shape[0]), int(w.shape[1])
    config = choose(n, k, _sms(x.device))
    return _launch(torch.library.wrap_triton(_kernel()), x, w, config)


_op: Any = None
# torch >= 2.6 with Triton; else skinny_linear launches directly (no tracing
# into it). Registering inspects the kernel's source, importing Triton.
if hasattr(torch.library, "triton_op") and available():
    _op = torch.library.triton_op("mmpipe::skinny_partials", _op_partials, mutates_args=())


def skinny_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias) for x [1..64, K] in half precision, accumulated
    in float32 and rounded once (as cuBLAS does). Usable inside torch.compile."""
    _check(x, w, bias)
    partials = torch.ops.mmpipe.skinny_partials(x, w) if _op is not None else skinny_partials(x, w)
    y = partials[0] if partials.shape[0] == 1 else partials.sum(0)
    if bias is not None:
        y = y + bias
    return y.to(x.dtype)


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def skinny_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations as types
        X, W, Out, M, N, K, sxm, swn, per_split,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    ):  # fmt: skip
        pid_n = tl.program_id(0)
        split = tl.program_id(1)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, BLOCK_M)
        kk = tl.arange(0, BLOCK_K)
        # Rows past N or M read a real row instead (the last) and are not
        # stored: loads without a row mask, and no out-of-bounds address.
        # 64-bit: an lm_head's N * K passes 2**31 at 14k hidden.
        w_rows = W + tl.minimum(n, N - 1).to(tl.int64)[:, None] * swn
        x_rows = X + tl.minimum(m, M - 1)[:, None] * sxm
        # The weight is the MMA's long side ([BLOCK_N, BLOCK_K] @ [BLOCK_K,
        # BLOCK_M]): tl.dot wants 16 rows at least on its other side, and
        # on Hopper a 64-row side is what wgmma takes.
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        start = split * per_split
        end = tl.minimum(start + per_split, K)
        for k0 in range(start, end, BLOCK_K):
            k = k0 + kk
            if EVEN_K:
                w = tl.load(w_rows + k[None, :])
                x = tl.load(x_rows + k[None, :])
            else:
                w = tl.load(w_rows + k[None, :], mask=k[None, :] < K, other=0.0)
                x = tl.load(x_rows + k[None, :], mask=k[None, :] < K, other=0.0)
            acc = tl.dot(w, tl.trans(x), acc)
        out = Out + split * M * N + m[None, :] * N + n[:, None]
        tl.store(out, acc, mask=(n[:, None] < N) & (m[None, :] < M))

    return skinny_kernel
