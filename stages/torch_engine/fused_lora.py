"""LoRA adapters on the fused layer step and the graphed prefill
(stages/torch_engine/fused_decode.py, slot_prefill.py). Those call a
layer's concatenated weights (Q, K and V as one projection; gate and up as
one), never the modules a ``LoraLinear`` wraps, so the adapters come to
them as stacks of their own.

For each fused projection every loaded adapter's A and B of the
projection's modules sit side by side, all slots in one pair of matrices:
A [slots · width, in] and B [out, slots · width], where a slot's ``width``
columns hold each module's rank in turn (padded to the largest of that
module's adapters), and B's rows of one module touch only that module's
columns. A row's update is then

    delta = ((x Aᵀ) · scales[slot]) Bᵀ

with ``scales[slot]`` [slots · width] the row's adapter's scale on its own
columns and zero on every other slot's. Two matrix products over every
slot, no gather of weights per row: the modules' form (``LoraLinear``)
gathers each row's A and B, [rows, rank, in] a projection, where here a
step reads every adapter's A and B once; the inner sizes are small (slots ×
ranks), the shapes static, so a CUDA graph replays it with each step's
slots. Slot 0, no adapter, is zeros: a row without one adds exactly zero.

The scale multiplies the rank columns before B where PEFT scales B's
output: the same product, rounded in another order in the last bits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from stages.torch_engine.lora import LoraAdapter

# A fused projection's modules, by their paths in a decoder layer, in the
# order fuse_layer concatenates their weights.
PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}

# (A [slots · width, in], B [out, slots · width], scales [slots, slots · width]).
ProjectionLora = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class LayerLora:
    """A decoder layer's adapters by fused projection (None: no adapter
    targets any of its modules)."""

    qkv: ProjectionLora | None
    o: ProjectionLora | None
    gate_up: ProjectionLora | None
    down: ProjectionLora | None


# A layer of a model with no adapter loaded.
NO_LORA = LayerLora(None, None, None, None)


def lora_delta(x: torch.Tensor, lora: ProjectionLora, slots: torch.Tensor) -> torch.Tensor:
    """Each row of ``x`` [rows, in]'s update by its adapter slot ``slots`` [rows]."""
    a, b, scales = lora
    return F.linear(F.linear(x, a) * scales[slots], b)


def layer_loras(
    layers: list[str],
    sizes: Mapping[str, tuple[int, int]],
    adapters: Mapping[int, LoraAdapter],
    slots: int,
    device: torch.device,
    dtype: torch.dtype,
    rank: int = 0,
) -> list[LayerLora] | None:
    """The stacks of every decoder layer (``layers``: their module paths in
    the model; ``sizes``: each linear layer's (in, out) by path) for
    ``adapters`` by slot, ``slots`` slots in all; None when no adapter is
    loaded. ``rank``: every module's columns that many in each slot, on
    every projection, adapters or not (vLLM's max_lora_rank): the shapes of
    every load, which ``refill`` writes in place."""
    if not adapters and not rank:
        return None
    out = []
    for layer in layers:
        made = {
            name: _projection([f"{layer}.{m}" for m in modules], sizes, adapters, slots, device, dtype, rank)
            for name, modules in PROJECTIONS.items()
        }
        out.append(LayerLora(**made))
    return out


def refill(stacks: list[LayerLora], made: list[LayerLora]) -> None:
    """``made``'s values written into ``stacks`` of the same shapes, in
    place: a CUDA graph captured over ``stacks`` replays ``made`` (queued in
    stream order: a step launched before reads the old)."""
    for old, new in zip(stacks, made, strict=True):
        for name in PROJECTIONS:
            was, now = getattr(old, name), getattr(new, name)
            assert was is not None and now is not None, "stacks of a fixed rank cover every projection"
            for kept, value in zip(was, now, strict=True):
                kept.copy_(value)


def _projection(
    modules: list[str],
    sizes: Mapping[str, tuple[int, int]],
    adapters: Mapping[int, LoraAdapter],
    slots: int,
    device: torch.device,
    dtype: torch.dtype,
    rank: int = 0,
) -> ProjectionLora | None:
    ranks = [rank] * len(modules) if rank else [
        max((a.modules[m].rank for a in adapters.values() if m in a.modules), default=0) for m in modules
    ]  # fmt: skip
    width = sum(ranks)
    if not width:
        return None
    fan_in = sizes[modules[0]][0]
    outs = [sizes[m][1] for m in modules]
    a = torch.zeros(slots * width, fan_in)
    b = torch.zeros(sum(outs), slots * width)
    scales = torch.zeros(slots, slots * width)
    for slot, adapter in adapters.items():
        column, row = slot * width, 0
        for module, rank, size in zip(modules, ranks, outs, strict=True):
            weights = adapter.modules.get(module)
            if weights is not None:
                r = weights.rank
                a[column : column + r] = weights.a
                b[row : row + size, column : column + r] = weights.b
                scales[slot, column : column + r] = weights.scale
            column, row = column + rank, row + size
    return a.to(device, dtype), b.to(device, dtype), scales.to(device, dtype)
