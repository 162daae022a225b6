"""What a worker remembers of each media item it encoded or prefilled, by
content digest: enough to stand in for the item's embeddings where the
prefix cache holds its tokens, so that neither the tower nor a hand-off
runs for it (as vLLM skips the encoder for media its prefix cache covers)."""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import torch

from schemas.processed import MediaKind
from stages.families.base import Grid, MediaEmbedding

# A few dozen bytes each: far more media than a KV pool holds.
_REMEMBERED = 8192


class _Layout(NamedTuple):
    num_tokens: int
    grid_thw: Grid
    kind: MediaKind
    seconds_per_grid: float


class MediaLayouts:
    """The layouts of the last ``size`` media items seen here, least recently seen forgotten first."""

    def __init__(self, size: int = _REMEMBERED) -> None:
        self._size = size
        self._layouts: OrderedDict[str, _Layout] = OrderedDict()

    def __len__(self) -> int:
        return len(self._layouts)

    def remember(self, media: list[MediaEmbedding]) -> None:
        for m in media:
            if not m.digest:
                continue
            self._layouts[m.digest] = _Layout(m.num_tokens, m.grid_thw, m.kind, m.seconds_per_grid)
            self._layouts.move_to_end(m.digest)
        while len(self._layouts) > self._size:
            self._layouts.popitem(last=False)

    def stand_ins(
        self, digests: list[str], hidden: int, dtype: torch.dtype, device: torch.device
    ) -> list[MediaEmbedding] | None:
        """Embeddings no forward reads (zeros, ``encoded=False``) of each
        item's size and layout; None where any digest is not remembered."""
        if not digests or any(not d or d not in self._layouts for d in digests):
            return None
        out = []
        for digest in digests:
            layout = self._layouts[digest]
            self._layouts.move_to_end(digest)
            zeros = torch.zeros(layout.num_tokens, hidden, dtype=dtype, device=device)
            out.append(
                MediaEmbedding(zeros, layout.grid_thw, layout.kind, layout.seconds_per_grid, digest, encoded=False)
            )
        return out
