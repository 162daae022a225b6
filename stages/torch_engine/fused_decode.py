"""A decoder layer's step for a GPU: fewer, larger kernels than the model's
modules launch.

The model's modules launch some thirty kernels a layer for one token (each
norm alone is six elementwise kernels); at a few microseconds each that,
not reading the weights, is what a decode step of a small model costs.
Here a layer is three pieces: before attention (the previous layer's
residual add, norm, one QKV projection over concatenated weights, RoPE and
the cache write into the row's block), attention over the paged cache
(grouped-query without repeating keys and values; on a GPU in half
precision the Triton kernel of stages/torch_engine/kernels/triton_decode.py,
reading a row's own blocks and no padding; elsewhere the masked forms of
stages/torch_engine/decode_attention.py), and after it (output projection;
residual, norm, one gate+up projection, SiLU, down projection).
``torch.compile`` fuses each piece's elementwise work into a few kernels;
the batch decoder captures the lot in a CUDA graph.

The arithmetic is the models' (RMSNorm in float32 then the weight in the
activations' dtype, RoPE by rotate-half, softmax in float32), but fused
kernels and a concatenated projection round differently from the modules
in the last bits: in bf16 greedy tokens may part from generate() after a
while, as any batched engine's do. The CPU keeps the modules (exactly
generate()'s tokens); this path runs where speed is the point.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from stages.torch_engine.decode_attention import (
    StepAttention,
    attend,
    attend_sdpa,
    gather_blocks,
    masked_step,
    rows_step,
)
from stages.torch_engine.fused_lora import ProjectionLora, lora_delta
from stages.torch_engine.kernels import triton_decode, triton_linear

# y = x @ w.T (+ bias): F.linear (cuBLAS), or the skinny Triton kernel.
Linear = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class FusedLayer:
    ln1: torch.Tensor
    qkv: torch.Tensor  # [(heads + 2 kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    ln2: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor
    eps: float


def can_fuse(layer: Any) -> bool:
    attn, mlp = layer.self_attn, layer.mlp
    silu = type(getattr(mlp, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation")
    no_bias = attn.o_proj.bias is None and all(
        getattr(mlp, n).bias is None for n in ("gate_proj", "up_proj", "down_proj")
    )
    return silu and no_bias and hasattr(layer.input_layernorm, "variance_epsilon")


def fuse_layer(layer: Any) -> FusedLayer:
    """Concatenate a layer's Q, K, V and gate, up weights; the modules' own
    parameters become views into them, so no weight is held twice."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = _concat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    bias = None
    if attn.q_proj.bias is not None:
        bias = _concat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
    gate_up = _concat([mlp.gate_proj.weight, mlp.up_proj.weight])
    return FusedLayer(
        ln1=layer.input_layernorm.weight,
        qkv=qkv,
        qkv_bias=bias,
        o=attn.o_proj.weight,
        ln2=layer.post_attention_layernorm.weight,
        gate_up=gate_up,
        down=mlp.down_proj.weight,
        eps=float(layer.input_layernorm.variance_epsilon),
    )


def _concat(params: list[torch.nn.Parameter]) -> torch.Tensor:
    whole = torch.cat([p.detach() for p in params])
    start = 0
    for p in params:
        p.data = whole[start : start + p.shape[0]]
        start += p.shape[0]
    return whole


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


def before_attention(
    hidden: torch.Tensor,
    delta: torch.Tensor | None,
    ln: torch.Tensor,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    kv_heads: int,
    keys: torch.Tensor,
    values: torch.Tensor,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
    lora: ProjectionLora | None = None,
    slots: torch.Tensor | None = None,
    linear: Linear = F.linear,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [b, hidden] plus the last layer's MLP output ``delta`` (None
    before the first layer) → (hidden, q [b, heads, d]); writes the new key
    and value of row r into a layer's pool keys, values [blocks, kv_heads,
    block_size, d] at (blocks[r], offsets[r]). cos, sin [b, 1, d]. ``lora``:
    the QKV projection's adapters, row r's by its slot ``slots[r]``.

    The residual add of the layer before is done here so that it, the norm,
    RoPE and the cache write are a couple of kernels rather than one each."""
    if delta is not None:
        hidden = hidden + delta
    b, d = hidden.shape[0], cos.shape[-1]
    qkv = project_qkv(rms_norm(hidden, ln, eps), qkv_weight, qkv_bias, lora, slots, linear)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    keys[blocks, :, offsets] = rope(k.view(b, kv_heads, d), cos, sin)
    values[blocks, :, offsets] = v.view(b, kv_heads, d)
    return hidden, rope(q.view(b, heads, d), cos, sin)


def after_attention(
    hidden: torch.Tensor,
    projected: torch.Tensor,
    ln: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    eps: float,
    gate_up_lora: ProjectionLora | None = None,
    down_lora: ProjectionLora | None = None,
    slots: torch.Tensor | None = None,
    linear: Linear = F.linear,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden plus attention's output projection ``projected`` → (hidden
    after attention, the MLP's output): the next layer (or ``final``) adds
    the two, in the models' order. ``gate_up_lora``, ``down_lora``: those
    projections' adapters, row r's by its slot ``slots[r]``.

    The projection comes in made (``FusedKernels.project``): compiled
    together, its matmul and the residual add became one addmm, whose
    residual is first copied into the output (a kernel a layer more) and
    which rounds the sum once where the models round the product first."""
    hidden = hidden + projected
    normed = rms_norm(hidden, ln, eps)
    both = linear(normed, gate_up)
    if gate_up_lora is not None:
        assert slots is not None
        both = both + lora_delta(normed, gate_up_lora, slots)
    gate, up = both.chunk(2, dim=-1)
    acted = F.silu(gate) * up
    out = linear(acted, down)
    if down_lora is not None:
        assert slots is not None
        out = out + lora_delta(acted, down_lora, slots)
    return hidden, out


def project_qkv(
    normed: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora: ProjectionLora | None,
    slots: torch.Tensor | None,
    linear: Linear = F.linear,
) -> torch.Tensor:
    """The concatenated Q, K, V projection, plus each row's adapter's update."""
    qkv = linear(normed, weight, bias)
    if lora is not None:
        assert slots is not None
        qkv = qkv + lora_delta(normed, lora, slots)
    return qkv


def project_out(
    attended: torch.Tensor,
    weight: torch.Tensor,
    lora: ProjectionLora | None,
    slots: torch.Tensor | None,
    linear: Linear = F.linear,
) -> torch.Tensor:
    """Attention's output projection, plus each row's adapter's update."""
    out = linear(attended, weight)
    if lora is not None:
        assert slots is not None
        out = out + lora_delta(attended, lora, slots)
    return out


def skinny_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton kernel up to its batch limit, cuBLAS past it (a decoder
    of more than 64 slots)."""
    if x.shape[0] <= triton_linear.MAX_M:
        return triton_linear.skinny_linear(x, w, bias)
    return F.linear(x, w, bias)


def final(hidden: torch.Tensor, delta: torch.Tensor, ln: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm(hidden + delta, ln, eps)


def default_attention(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """On CUDA in half precision the Triton kernel where Triton is
    installed and the head size suits it; elsewhere SDPA under a length
    mask over the gathered blocks. (flash-attention's own paged kernel
    wants blocks of 256 tokens and more.)"""
    cuda_half = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
    if cuda_half and triton_decode.supported(head_dim) and importlib.util.find_spec("triton") is not None:
        return "triton"
    return "sdpa"


RECOMPILE_LIMIT = 64


def _bound(piece: Callable[..., Any], linear: Linear) -> Callable[..., Any]:
    # A closure, not an argument: torch.compile takes the kernel as a constant.
    def bound(*args: Any) -> Any:
        return piece(*args, linear=linear)

    return bound


class FusedKernels:
    """The pieces, compiled once for every layer (weights and the layer's
    cache are arguments, never attributes, so one graph serves them all) and
    for any batch and length (dynamic shapes).

    ``attention``: "triton" reads each row's own blocks and nothing more
    (one graph per batch size); "sdpa" (torch's fused kernels) and
    "compiled" (the grouped matmuls, compiled) read ``span`` positions of
    every row, gathered through the block tables, under a mask. ``mode``:
    torch.compile's (e.g. "max-autotune-no-cudagraphs").
    ``linear``: the projections' kernel, "cublas" (F.linear) or "triton"
    (``skinny_linear``: faster alone at every decode shape measured, but in
    the compiled step only at one row, and slower at 32 rows (README,
    Benchmarks), so not the default)."""

    def __init__(
        self,
        compile: bool,
        attention: str = "sdpa",
        mode: str | None = None,
        linear: str = "cublas",
    ) -> None:
        if attention not in ("triton", "sdpa", "compiled"):
            raise ValueError(f"attention {attention!r}: triton, sdpa or compiled")
        if linear not in ("cublas", "triton"):
            raise ValueError(f"linear {linear!r}: cublas or triton")
        wrap = (lambda fn: torch.compile(fn, dynamic=True, mode=mode)) if compile else (lambda fn: fn)
        if compile:
            # A piece compiles again per model (head counts are constants), for one row
            # (a size-1 dimension specializes) and for the first layer (no delta): six
            # graphs a model on one code object. Past torch's default of eight, the
            # rest would run eagerly without a word but a warning (a second model in
            # one process did: bench decode's 7B after its 2B).
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        self.attention = attention
        self.linear = linear
        project: Linear = skinny_linear if linear == "triton" else F.linear
        self.project = project
        self.before_attention = wrap(_bound(before_attention, project))
        self.after_attention = wrap(_bound(after_attention, project))
        self.final = wrap(final)
        self._masked = attend_sdpa if attention == "sdpa" else wrap(attend)

    @property
    def masked(self) -> bool:
        return self.attention != "triton"

    def prepare(
        self,
        bucket: int,
        span: int,
        write_at: torch.Tensor,
        table: torch.Tensor,
        counters: torch.Tensor | None = None,
    ) -> StepAttention:
        """What ``attend`` needs of a step, once for every layer: ``table``
        the rows' block tables (masked: the span's blocks), ``counters`` the
        Triton kernel's, kept by the caller for every step."""
        if self.masked:
            return masked_step(bucket, span, write_at, table)
        return rows_step(bucket, write_at, table, counters)

    def attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, step: StepAttention, scaling: float
    ) -> torch.Tensor:
        """q [bucket, heads, d] over a layer's pool [blocks, kv_heads, block_size, d]."""
        if self.attention == "triton":
            assert step.lengths is not None
            return triton_decode.attend(q, keys, values, step.lengths, step.table, scaling, step.counters)
        assert step.mask is not None
        return self._masked(q, gather_blocks(keys, step.table), gather_blocks(values, step.table), step.mask, scaling)
