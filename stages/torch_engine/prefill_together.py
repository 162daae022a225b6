"""Several prompts' prefill in one forward of the language model.

The prompts are left-padded to the longest, so every row's last token sits in
the last column and ``logits_to_keep=1`` gives each row's next-token logits
without the whole [rows, length, vocab] tensor. The attention mask hides the
padding from every real token; each row keeps its own explicit positions
(Qwen-VL's M-RoPE included), so no row's positions depend on another's
length. Each sequence then gets a cache of its own: its row of every layer,
without the padding, copied out so the batch's tensors can go.
"""

from __future__ import annotations

from typing import Any

import torch

from stages.device_copy import to_device
from stages.families import Family
from stages.families.base import cache_kwarg

# Tokens, padding included, one forward may take (rows × the longest row):
# a bound on the activations and the temporary all-rows cache.
PADDED_TOKEN_BUDGET = 16384


def padded_groups(lengths: list[int], budget: int = PADDED_TOKEN_BUDGET) -> list[list[int]]:
    """Indices of prompts grouped for padded forwards: by length (less
    padding), each group's rows × longest within ``budget`` (a prompt longer
    than that alone)."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if groups and (len(groups[-1]) + 1) * lengths[i] <= budget:
            groups[-1].append(i)  # sorted: this one is the group's longest
        else:
            groups.append([i])
    return groups


def padded_forward(
    model: Any, family: Family, embeds: list[torch.Tensor], positions: list[torch.Tensor]
) -> tuple[torch.Tensor, list[Any]]:
    """(next-token logits [rows, vocab], one cache per row) of prompts given
    as embeddings [1, L, hidden] and positions (batch in dim -2, tokens last)."""
    from transformers import DynamicCache

    lengths = [int(e.shape[1]) for e in embeds]
    longest = max(lengths)
    device = model.device
    rows, places, mask = [], [], torch.zeros(len(embeds), longest, dtype=torch.long, device=device)
    for i, (embed, pos, n) in enumerate(zip(embeds, positions, lengths, strict=True)):
        pad = longest - n
        rows.append(torch.nn.functional.pad(embed, (0, 0, pad, 0)))
        places.append(torch.cat([torch.zeros((*pos.shape[:-1], pad), dtype=pos.dtype), pos], dim=-1))
        mask[i, pad:] = 1
    out = model(
        inputs_embeds=torch.cat(rows),
        attention_mask=mask,
        position_ids=to_device(torch.cat(places, dim=-2), device),
        use_cache=True,
        logits_to_keep=1,
        **{cache_kwarg(model.__class__): None},
    )
    cache = getattr(out, "cache", None) or out.past_key_values
    caches = []
    for i, n in enumerate(lengths):
        layers = [
            (
                layer.keys[i : i + 1, :, longest - n :].contiguous(),
                layer.values[i : i + 1, :, longest - n :].contiguous(),
            )
            for layer in cache.layers
        ]
        caches.append(DynamicCache(ddp_cache_data=layers))
    return out.logits[:, -1], caches


__all__ = ["PADDED_TOKEN_BUDGET", "padded_forward", "padded_groups"]
