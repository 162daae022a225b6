"""Prompt embeddings as input (``prompt_embeds`` in ``/v1/completions``,
as vLLM takes them): a tensor of the prompt's input embeddings, [tokens,
hidden] (or [1, tokens, hidden]), sent as the bytes of ``torch.save`` or of
a safetensors file holding one tensor. The processor checks them against
the model; the worker that prefills loads them again (the request carries
the client's bytes, once, so a restart from the first hop has them)."""

from __future__ import annotations

import io

import torch

from schemas.errors import InvalidRequest

# The dtypes a language model's input embeddings come in.
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def load_prompt_embeds(data: bytes, hidden_size: int) -> torch.Tensor:
    """The [tokens, hidden_size] tensor ``data`` holds, on the CPU, checked:
    a 400 (``InvalidRequest``) for anything else."""
    tensor = _load(data)
    if tensor.dim() == 3 and tensor.shape[0] == 1:
        tensor = tensor[0]
    if tensor.dim() != 2 or tensor.shape[0] < 1:
        raise InvalidRequest(f"prompt_embeds must be [tokens, {hidden_size}]; got {list(tensor.shape)}")
    if tensor.shape[1] != hidden_size:
        raise InvalidRequest(f"prompt_embeds of width {tensor.shape[1]}; this model's hidden size is {hidden_size}")
    if tensor.dtype not in DTYPES:
        raise InvalidRequest(f"prompt_embeds of dtype {tensor.dtype}; take float32, float16 or bfloat16")
    if not bool(torch.isfinite(tensor).all()):
        raise InvalidRequest("prompt_embeds hold NaN or infinite values")
    return tensor


def _load(data: bytes) -> torch.Tensor:
    if data[:2] == b"PK":  # torch.save's zip
        try:
            # weights_only: plain tensors, no code run from a client's pickle.
            loaded = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise InvalidRequest(f"prompt_embeds could not be loaded as a torch-saved tensor: {exc}") from None
        if not isinstance(loaded, torch.Tensor):
            raise InvalidRequest(f"prompt_embeds hold a {type(loaded).__name__}, not a tensor")
        return loaded
    from safetensors.torch import load as load_safetensors

    try:
        tensors = load_safetensors(data)
    except Exception as exc:
        raise InvalidRequest(f"prompt_embeds are neither torch-saved nor a safetensors file: {exc}") from None
    if len(tensors) != 1:
        raise InvalidRequest(f"a safetensors prompt_embeds must hold one tensor; it holds {len(tensors)}")
    return next(iter(tensors.values()))
