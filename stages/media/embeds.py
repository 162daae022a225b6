"""Precomputed media embeddings: a ``.safetensors`` payload a client made with
the model's own encoder, sent instead of the media.

The format (``safetensors`` never unpickles, so untrusted bytes are safe to
parse): ``embeddings`` float [tokens, hidden], and for families whose
positions need it (Qwen-VL) ``grid`` int [3], the (t, h, w) patch grid
before the merge. Whether the shape fits the model is the engine's check;
here only the structure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from schemas.errors import InvalidMedia

_FLOATS = ("F32", "F16", "BF16", "F64")
_INTS = ("I64", "I32", "I16", "U8", "I8")


@dataclass(frozen=True)
class PrecomputedEmbedding:
    embeddings: Any  # torch.Tensor [tokens, hidden]
    grid: tuple[int, ...]  # empty when the payload has none


def parse_embeddings(data: bytes) -> PrecomputedEmbedding:
    import safetensors
    import safetensors.torch

    try:
        tensors = safetensors.torch.load(data)
    except (safetensors.SafetensorError, ValueError, OSError) as exc:
        raise InvalidMedia(f"precomputed embeddings are not a valid .safetensors payload: {exc}") from None
    unknown = sorted(set(tensors) - {"embeddings", "grid"})
    if "embeddings" not in tensors or unknown:
        raise InvalidMedia(
            f"precomputed embeddings hold {sorted(tensors)}; expected 'embeddings' [tokens, hidden] and, for "
            "Qwen-VL, 'grid' [3]"
        )
    embeddings = tensors["embeddings"]
    if embeddings.ndim != 2 or not embeddings.is_floating_point() or embeddings.shape[0] == 0:
        raise InvalidMedia(
            f"'embeddings' must be a non-empty float tensor [tokens, hidden], got {embeddings.dtype} "
            f"{list(embeddings.shape)}"
        )
    grid: tuple[int, ...] = ()
    if "grid" in tensors:
        g = tensors["grid"]
        if g.ndim != 1 or g.is_floating_point() or g.numel() > 4 or bool((g <= 0).any()):
            raise InvalidMedia(f"'grid' must be a few positive integers, got {g.dtype} {g.tolist()}")
        grid = tuple(int(v) for v in g.tolist())
    return PrecomputedEmbedding(embeddings, grid)
