"""Model families: the architecture-specific part of running a checkpoint.

A family adapter knows how a model of its architecture takes images
(preprocessing, vision tower, placeholder expansion), positions and the
language-model forward. The engine is generic over it.
"""

from __future__ import annotations

from stages.families.qwen2_vl import Qwen2VLFamily

FamilyAdapter = Qwen2VLFamily  # the one family so far; becomes a Protocol with the second

FAMILIES: dict[str, type[Qwen2VLFamily]] = {arch: Qwen2VLFamily for arch in Qwen2VLFamily.architectures}


def family_for_architecture(architecture: str) -> type[Qwen2VLFamily]:
    try:
        return FAMILIES[architecture]
    except KeyError:
        raise ValueError(
            f"no model family for architecture {architecture!r}; supported: {', '.join(sorted(FAMILIES))}"
        ) from None


__all__ = ["FAMILIES", "FamilyAdapter", "Qwen2VLFamily", "family_for_architecture"]
