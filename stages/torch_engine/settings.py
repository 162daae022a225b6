"""Engine settings a process sets before any model loads: plain data, no
torch import (the bridge and the CLI read them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeSettings:
    """The batch decoder: every running sequence in one forward over a
    preallocated cache of ``slots`` sequences of ``max_len`` tokens each
    (CUDA graphs on a GPU). Off, or for a sequence that does not fit, each
    sequence runs the model on its own cache."""

    batched: bool = True
    slots: int = 32
    max_len: int = 4096
    cuda_graphs: bool = True
    # The fused layer step (stages.torch_engine.fused_decode) instead of the
    # model's modules; None: on CUDA only (the CPU keeps generate()'s exact
    # numerics).
    fused: bool | None = None
