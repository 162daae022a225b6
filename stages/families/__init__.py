"""Model families: the architecture-specific part of running a checkpoint.

A family adapter knows how a model of its architecture takes media
(preprocessing, the encoder, placeholder expansion), positions and the
language-model forward. The engine is generic over it (``base.Family``).
"""

from __future__ import annotations

from stages.families.base import Family, Grid, Media, MediaEmbedding, PreparedImage, kind_of
from stages.families.llava import LlavaFamily
from stages.families.llava_next_video import LlavaNextVideoFamily
from stages.families.qwen2_audio import Qwen2AudioFamily
from stages.families.qwen2_vl import Qwen2VLFamily, Qwen25VLFamily

_ADAPTERS: tuple[type[Family], ...] = (
    Qwen2VLFamily,
    Qwen25VLFamily,
    LlavaFamily,
    LlavaNextVideoFamily,
    Qwen2AudioFamily,
)
FAMILIES: dict[str, type[Family]] = {arch: cls for cls in _ADAPTERS for arch in cls.architectures}


def family_for_architecture(architecture: str) -> type[Family]:
    try:
        return FAMILIES[architecture]
    except KeyError:
        raise ValueError(
            f"no model family for architecture {architecture!r}; supported: {', '.join(sorted(FAMILIES))}"
        ) from None


__all__ = [
    "FAMILIES",
    "Family",
    "Grid",
    "LlavaFamily",
    "LlavaNextVideoFamily",
    "Media",
    "MediaEmbedding",
    "PreparedImage",
    "Qwen2AudioFamily",
    "Qwen2VLFamily",
    "Qwen25VLFamily",
    "family_for_architecture",
    "kind_of",
]
