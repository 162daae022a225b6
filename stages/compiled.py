"""How the engine's pieces go through ``torch.compile`` on a GPU."""

from __future__ import annotations

from typing import Any

# Dynamic shapes: one compilation serves every prompt length, batch and
# image grid (weights and caches are arguments, so every layer too).
# Inductor rounds where the models round (to bf16 between a norm and its
# weight, say): without it, fused kernels kept float32 between the ops and
# a prefill's logits parted from the modules' twice as far (tiny model,
# bf16: 0.23 against 0.125; with it the compiled prefill gave the
# uncompiled one's logits bit for bit).
OPTIONS: dict[str, Any] = {"dynamic": True, "options": {"emulate_precision_casts": True}}
