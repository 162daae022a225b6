"""One attention call per vision-tower layer for all the images of a call.

Without a flash-attention package, transformers' Qwen-VL towers attend each
image on its own: per layer they read the images' lengths back from the GPU
(a host sync) and launch one attention per image, each too small to fill
the GPU. Batching several requests' images into one tower call
(``--encode-batch``) gains little that way. Registered under a name with
"flash" in it, this function gets what the towers give flash attention
instead (the packed sequence and its ``cu_seqlens``, lengths computed once
per call) and runs one variable-length attention over every image: torch's
own ``varlen_attn`` (flash attention, CUDA, half precision).

Elsewhere (CPU, float32) it attends image by image with SDPA as the towers
do, the same tensors in the same order: so the CPU keeps ``generate()``'s
exact tokens, and the path is exercised in CI.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F

# transformers switches its towers to the packed path on "flash" in the name.
NAME = "mmpipe_flash_varlen"


def _varlen() -> Any:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10
        return None
    return varlen_attn


def varlen_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    is_causal: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query, key, value [1, heads, tokens, head_dim] → [1, tokens, heads, head_dim]."""
    if cu_seq_lens_q is None or cu_seq_lens_k is None or attention_mask is not None or is_causal or dropout:
        raise ValueError(f"{NAME} serves the vision towers' packed, bidirectional attention only")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [tokens, heads, head_dim]
    varlen_attn = _varlen()
    if varlen_attn is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        cu_q, cu_k = cu_seq_lens_q.to(torch.int32), cu_seq_lens_k.to(torch.int32)
        out = varlen_attn(q, k, v, cu_q, cu_k, int(max_length_q or q.shape[0]), int(max_length_k or k.shape[0]),
                          scale=scaling)  # fmt: skip
        return out.unsqueeze(0), None
    # The towers' own path: one SDPA per image.
    bounds = cu_seq_lens_q.tolist()
    outs = [
        F.scaled_dot_product_attention(
            query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], scale=scaling
        )
        for start, end in itertools.pairwise(bounds)
    ]
    return torch.cat(outs, dim=2).transpose(1, 2), None


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the packed path would run on ``device`` in ``dtype``."""
    return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and _varlen() is not None


def use_packed_attention(vision_config: Any) -> None:
    """Make a loaded Qwen-VL tower attend through ``varlen_attention``."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, varlen_attention)
    vision_config._attn_implementation = NAME
