"""A hop stage of a role that prefills and/or decodes with vLLM: the one
``HopStage``, on ``VllmHopEngine`` (hop_engine.py says how each step runs on
vLLM). What is built here: vLLM's engine arguments for the role (its KV
connector, the encoder-cache consumer) and, where the role encodes, mmpipe's
encoder on a torch copy of the checkpoint beside vLLM."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stages.contract import TensorStore
from stages.encoder import MediaEncoder
from stages.hop import HopStage
from stages.media import EmbeddingCache, MediaFetcher, MediaPolicy
from stages.torch_engine.scheduler import EngineThread
from stages.vllm_engine.args import STORAGE_TTL_S, KvConnectorSettings, kv_transfer_config
from stages.vllm_engine.engine import VllmEngine
from stages.vllm_engine.hop_engine import VllmHopEngine
from stages.vllm_engine.media import ec_transfer_config

# Families whose embeddings vLLM takes (media.mm_prompt): Qwen-VL's images
# and videos, Qwen2-Audio's audio.
_ARCHITECTURES = (
    "Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen2AudioForConditionalGeneration",
)


def build_vllm_stage(
    role: str,
    model_dir: Path,
    served_name: str,
    engine_args: dict[str, Any],
    tensors: TensorStore | None = None,
    device: str = "cpu",
    media_policy: MediaPolicy | None = None,
    embedding_cache: EmbeddingCache | None = None,
    kv: KvConnectorSettings | None = None,
    ec_path: str = "",
    storage_ttl_s: float = STORAGE_TTL_S,
) -> HopStage:
    """A vLLM stage of ``role``; the engine itself starts in ``start()``.
    A role that encodes also loads the checkpoint on torch for its encoder.
    A prefill role on ExampleConnector prunes its folder (``storage_ttl_s``)."""
    from transformers import AutoConfig

    architectures = list(getattr(AutoConfig.from_pretrained(str(model_dir)), "architectures", None) or [])
    if not set(architectures) & set(_ARCHITECTURES):
        raise ValueError(
            f"the vLLM engine serves {', '.join(_ARCHITECTURES)} checkpoints so far; {model_dir} is {architectures}"
        )
    kv = kv or KvConnectorSettings()
    transfer = kv_transfer_config(role, kv)
    if transfer is not None and "kv_transfer_config" not in engine_args:  # --vllm-arg wins
        engine_args = {**engine_args, "kv_transfer_config": transfer}
    if ec_path and not role.startswith("encode") and "ec_transfer_config" not in engine_args:
        # The consumer of a vLLM encode hop's encoder outputs (built-in encode
        # hops' embeddings still come as image_embeds beside them).
        engine_args = {**engine_args, "ec_transfer_config": ec_transfer_config(False, ec_path)}
    engine = VllmEngine(model_dir, engine_args, role=role, kv=kv, storage_ttl_s=storage_ttl_s)
    encoder = None
    if role.startswith("encode"):
        from stages.torch_engine.engine import TorchEngine
        from stages.torch_engine.settings import DecodeSettings

        torch_engine = TorchEngine(model_dir, device=device, decode=DecodeSettings(batched=False))
        policy = media_policy or MediaPolicy()
        encoder = MediaEncoder(torch_engine, EngineThread(), MediaFetcher(policy), policy, embedding_cache, tensors)
    return HopStage(role, VllmHopEngine(role, engine, tensors, encoder, ec_path or None), served_name)


__all__ = ["build_vllm_stage"]
