"""A decoder layer's step for a GPU: fewer, larger kernels than the model's
modules launch.

The model's modules launch some thirty kernels a layer for one token (each
norm alone is six elementwise kernels); at a few microseconds each that,
not reading the weights, is what a decode step of a small model costs.
Here a layer is three pieces around the cache write: before attention
(norm, one QKV projection over concatenated weights, RoPE), attention over
the cache (grouped-query without repeating keys and values), and after it
(output projection, residual, norm, one gate+up projection, SiLU, down
projection, residual). ``torch.compile`` fuses each piece's elementwise
work into a few kernels; the batch decoder captures the lot in a CUDA graph.

The arithmetic is the models' (RMSNorm in float32 then the weight in the
activations' dtype, RoPE by rotate-half, softmax in float32), but fused
kernels and a concatenated projection round differently from the modules
in the last bits: in bf16 greedy tokens may part from generate() after a
while, as any batched engine's do. The CPU keeps the modules (exactly
generate()'s tokens); this path runs where speed is the point.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


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
    ln: torch.Tensor,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [b, hidden] → q [b, heads, d], k and v [b, kv_heads, d]; cos, sin [b, 1, d]."""
    b, d = hidden.shape[0], cos.shape[-1]
    qkv = F.linear(rms_norm(hidden, ln, eps), qkv_weight, qkv_bias)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    return rope(q.view(b, heads, d), cos, sin), rope(k.view(b, kv_heads, d), cos, sin), v.view(b, kv_heads, d)


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


def after_attention(
    hidden: torch.Tensor,
    attended: torch.Tensor,
    o_weight: torch.Tensor,
    ln: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    hidden = hidden + F.linear(attended, o_weight)
    gate, up = F.linear(rms_norm(hidden, ln, eps), gate_up).chunk(2, dim=-1)
    return hidden + F.linear(F.silu(gate) * up, down)


class FusedKernels:
    """The three pieces, compiled once for every layer (weights are arguments,
    never attributes, so one graph serves them all) and for any batch and
    length (dynamic shapes)."""

    def __init__(self, compile: bool, attention: str = "sdpa") -> None:
        wrap = (lambda fn: torch.compile(fn, dynamic=True)) if compile else (lambda fn: fn)
        self.before_attention = wrap(before_attention)
        # Measured on an H100 (Qwen2-VL-2B shapes, 32 rows): cuDNN's flash
        # kernel behind SDPA beats the compiled grouped matmuls, 2.9 ms a step
        # to 3.4 (README, Benchmarks).
        self.attend = attend_sdpa if attention == "sdpa" else wrap(attend)
        self.after_attention = wrap(after_attention)
