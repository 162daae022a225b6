"""Plain-torch stand-ins for the few ``sgl_kernel`` ops SGLang's CPU path
calls, for the CPU test venv (.venv-sglang, deploy/install-sglang.sh) only.

SGLang's kernel packages are CUDA-only wheels, yet its CPU path imports
``sgl_kernel`` and looks some ops up under ``torch.ops.sgl_kernel`` as its
modules load. What a tiny Qwen2-VL on the CPU runs is written here in plain
torch; the rest is registered as ops that raise when called (a model that
needs them fails loudly, not wrongly). ``convert_weight_packed`` is left
out on purpose: its presence turns on SGLang's AMX kernels.

Never installed on a GPU host: there SGLang's own ``sgl_kernel`` runs.
"""

from __future__ import annotations

import torch

__version__ = "0.0.0+mmpipe-cpu-shim"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Request i's token slots start_offset[i]..end_offset[i] take the next
    end - start entries of ``out_cache_loc`` (requests in order): the Triton
    kernel ``assign_req_to_token_pool``'s work."""
    del pool_len  # the row length; req_to_token has it
    taken = 0
    for i, row in enumerate(req_pool_indices.tolist()):
        start, end = int(start_offset[i]), int(end_offset[i])
        req_to_token[row, start:end] = out_cache_loc[taken : taken + end - start]
        taken += end - start


def __getattr__(name: str):  # type: ignore[no-untyped-def]
    """Any other op SGLang imports by name: there, and raising if called."""
    if name.startswith("__"):
        raise AttributeError(name)
    return _unavailable(name)


# Ops SGLang's modules look up under torch.ops.sgl_kernel (registered by name:
# calling one raises). Left out: the names SGLang tests with hasattr() to
# choose a kernel path (convert_weight_packed turns on AMX, ...).
_LOOKED_UP = (
    "apply_gguf_moe_weights",
    "apply_multidimensional_rope_cpu",
    "apply_rotary_pos_emb_cpu",
    "biased_grouped_topk_cpu",
    "bmm_cpu",
    "causal_conv1d_weight_pack",
    "conv3d_embed_cpu",
    "conv3d_embed_weight_pack",
    "convert_scale_packed",
    "convert_weight_packed_scale_zp",
    "decode_attention_cpu",
    "deepseek_v4_topk_transform_512",
    "dsv4_fused_q_indexer_rope_hadamard_quant",
    "extend_attention_cpu",
    "flash_attn_varlen_func",
    "fp8_per_tensor_scaled_mm_cpu",
    "fp8_scaled_mm_cpu",
    "fused_add_rmsnorm_cpu",
    "fused_dual_residual_rmsnorm_cpu",
    "fused_experts_cpu",
    "fused_gdn_gating_cpu",
    "fused_input_proj_cpu",
    "fused_linear_sigmoid_mul",
    "fused_moe_router_cpu",
    "fused_norm_scale_shift_cpu",
    "fused_qk_gemma_rmsnorm_cpu",
    "fused_qk_gemma_rmsnorm_with_gate_cpu",
    "fused_qk_rmsnorm_apply_from_stats_cpu",
    "fused_qk_rmsnorm_cpu",
    "fused_qk_rmsnorm_sumsq_cpu",
    "fused_qkvzba_split_reshape_cat_contiguous_cpu",
    "fused_qkvzba_split_reshape_cat_cpu",
    "fused_rmsnorm_gated_cpu",
    "fused_scale_residual_norm_scale_shift",
    "fused_scale_residual_norm_scale_shift_cpu",
    "fused_scale_shift_cpu",
    "fused_sigmoid_gating_delta_rule_update_cpu",
    "fused_sigmoid_mul_cpu",
    "gelu_and_mul_cpu",
    "gelu_tanh_and_mul_cpu",
    "gemma3_rmsnorm_cpu",
    "gemma4_rmsnorm_cpu",
    "gemma_fused_add_rmsnorm_cpu",
    "gemma_rmsnorm_cpu",
    "grouped_topk_cpu",
    "image_preprocess_cpu",
    "init_cpu_threads_env",
    "initialize",
    "int4_scaled_mm_cpu",
    "int8_scaled_mm_with_quant",
    "l2norm_cpu",
    "layernorm_cpu",
    "multimodal_rotary_embedding_cpu",
    "murmur_hash32_cpu",
    "qkv_proj_with_rope_fused_weight",
    "query_device",
    "rmsnorm_cpu",
    "rotary_embedding",
    "rotary_embedding_cpu",
    "shared_expert_cpu",
    "shm_allgather",
    "shm_alltoall",
    "silu_and_mul_cpu",
    "store_cache_cpu",
    "topk_sigmoid_cpu",
    "topk_softmax_cpu",
    "topk_transform",
    "topk_transform_paged",
    "topk_transform_ragged",
    "weight_packed_linear",
)

_library = torch.library.Library("sgl_kernel", "DEF")


def _unavailable(name: str):  # type: ignore[no-untyped-def]
    def op(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise NotImplementedError(f"sgl_kernel.{name} has no CPU stand-in in mmpipe's test shim")

    return op


for _name in _LOOKED_UP:
    _library.define(f"{_name}(Tensor x) -> Tensor")
    _library.impl(_name, _unavailable(_name), "CompositeExplicitAutograd")
