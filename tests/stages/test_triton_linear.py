"""The skinny GEMM (stages/torch_engine/kernels/triton_linear.py) against
F.linear: batch sizes that are and are not a multiple of tl.dot's 16 rows, N
and K that are not multiples of the kernel's blocks, split-K, bias, and
inside torch.compile.
On CUDA only (Triton 3.5's CPU interpreter keeps bf16 as uint16 and its
tl.dot multiplies those integers: the kernel was checked there once with
that dot patched, which no test can rely on)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stages.torch_engine.kernels import triton_linear
from stages.torch_engine.kernels.triton_linear import skinny_linear, skinny_partials

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not triton_linear.available(),
    reason="the Triton GEMM runs on CUDA only here (needs a CUDA device and Triton)",
)

# (M, N, K): a decode batch of one, of three (not a multiple of 16), of 32
# and 64; N and K off the blocks (64, 128); Qwen2-VL-2B's qkv and down.
SHAPES = [(1, 2048, 1536), (3, 200, 384), (32, 1536, 8960), (32, 300, 1000), (64, 96, 300), (17, 4096, 256)]


def _inputs(m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(m * 7919 + n * 31 + k)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) * k**-0.5  # outputs ~N(0, 1)
    bias = torch.randn(n, generator=gen)
    return tuple(t.to("cuda", dtype) for t in (x, w, bias))


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same half-precision inputs, multiplied in float64 on the CPU (no TF32 question)."""
    out = F.linear(x.cpu().double(), w.cpu().double(), None if bias is None else bias.cpu().double())
    return out.float()


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_linear_is_f_linear(m: int, n: int, k: int, with_bias: bool) -> None:
    x, w, bias = _inputs(m, n, k)
    b = bias if with_bias else None
    got = skinny_linear(x, w, b)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    # Rounded once from float32: within bf16's half ulp of the exact sum, plus summation order.
    torch.testing.assert_close(got.float().cpu(), _reference(x, w, b), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got, F.linear(x, w, b), atol=2e-2, rtol=2e-2)


def test_float16() -> None:
    x, w, bias = _inputs(5, 640, 768, torch.float16)
    got = skinny_linear(x, w, bias)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float().cpu(), _reference(x, w, bias), atol=5e-3, rtol=5e-3)


@pytest.mark.parametrize(
    ("split_k", "block_n", "block_k"),
    [(1, 64, 128), (2, 32, 64), (3, 128, 128), (4, 64, 256), (5, 64, 64), (8, 64, 64)],
)
def test_partials_sum_to_the_product(split_k: int, block_n: int, block_k: int) -> None:
    """Any split of K, even ones that leave the last split short or empty."""
    x, w, _ = _inputs(3, 300, 1000)
    partials = skinny_partials(x, w, split_k, block_n=block_n, block_k=block_k)
    assert partials.shape == (split_k, 3, 300) and partials.dtype == torch.float32
    torch.testing.assert_close(partials.sum(0).cpu(), _reference(x, w), atol=1e-4, rtol=1e-4)
    again = skinny_partials(x, w, split_k, block_n=block_n, block_k=block_k)
    assert torch.equal(again, partials)  # no atomics: the same bits every time


def test_unsupported_shapes_raise() -> None:
    x, w, _ = _inputs(3, 64, 128)
    with pytest.raises(ValueError, match=r"1\.\.64"):
        skinny_linear(torch.zeros(65, 128, device="cuda", dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match=r"1\.\.64"):
        skinny_linear(torch.zeros(0, 128, device="cuda", dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="bfloat16"):
        skinny_linear(x.float(), w.float())
    with pytest.raises(ValueError, match="bfloat16"):
        skinny_linear(x, w.half())
    with pytest.raises(ValueError, match="want x"):
        skinny_linear(x[:, :100], w)
    with pytest.raises(ValueError, match="contiguous"):
        skinny_linear(x, w.t().contiguous().t())
    with pytest.raises(ValueError, match="bias"):
        skinny_linear(x, w, torch.zeros(63, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="split_k"):
        skinny_partials(x, w, 3, block_k=64)  # K 128 has two blocks of 64


# torch 2.11's inductor imports torch.utils.mkldnn, whose module body uses the
# deprecated torch.jit.script_method: torch's own warning, at compile time
# (tests/conftest.py ignores it under --engine-device cuda only).
@pytest.mark.filterwarnings("ignore:.*torch.jit.script_method.*:DeprecationWarning")
def test_inside_torch_compile() -> None:
    """Traced whole (fullgraph), dynamic in the batch as the fused step is,
    the partials' sum, bias and the residual add fused after the kernel."""

    def step(residual: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return residual + skinny_linear(x, w, bias)

    compiled = torch.compile(step, dynamic=True, fullgraph=True)
    for m, n, k in [(32, 1536, 8960), (3, 1536, 8960), (1, 1536, 8960), (32, 2048, 1536)]:
        x, w, bias = _inputs(m, n, k)
        residual = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        got = compiled(residual, x, w, bias)
        want = (residual.float().cpu() + _reference(x, w, bias)).to(torch.bfloat16)
        assert got.shape == (m, n) and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.cpu(), want, atol=2e-2, rtol=2e-2)
