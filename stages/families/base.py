"""What every model family adapter provides, and what most of them share.

The engine is generic: it asks the family how a checkpoint takes its media
(preprocessing, the encoder, how many tokens each item becomes), how the
prompt's positions are laid out (M-RoPE for Qwen-VL, plain 1-D elsewhere)
and how the language model is called. A family that runs the Hugging Face
model class the way ``generate()`` does gives the same tokens.
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch
from PIL import Image
from transformers import PretrainedConfig

# Grid of one encoded item, as the family needs it for positions (Qwen-VL:
# the (t, h, w) patch grid before the merge); carried from encode to prefill.
Grid = tuple[int, ...]


class Family(Protocol):
    name: ClassVar[str]
    architectures: ClassVar[tuple[str, ...]]
    image_token_id: int
    vocab_size: int
    max_position_embeddings: int
    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int

    hidden_size: int

    def __init__(self, model_dir: Path, config: PretrainedConfig) -> None: ...

    @property
    def model_class(self) -> Any: ...

    def encode(self, model: Any, images: list[Image.Image]) -> list[tuple[torch.Tensor, Grid]]: ...

    def num_image_tokens(self, grid: Grid) -> int: ...

    def embeddings_grid(self, grid: Grid, rows: int) -> Grid:
        """The grid of precomputed embeddings of ``rows`` tokens, from what the
        payload gave (``()`` if nothing); raises ValueError if they cannot fit."""
        ...

    def expand_placeholders(self, token_ids: list[int], num_tokens: list[int]) -> list[int]: ...

    def prompt_positions(self, token_ids: list[int], grids: list[Grid]) -> tuple[torch.Tensor, int]: ...

    def decode_positions(self, position: int) -> torch.Tensor: ...

    def embed_prompt(self, model: Any, token_ids: list[int], media_embeds: list[torch.Tensor]) -> torch.Tensor: ...

    def forward(
        self,
        model: Any,
        positions: torch.Tensor,
        cache: Any,
        *,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Any]: ...


class LanguageModelFamily:
    """The parts shared by families whose language model is a decoder-only
    Hugging Face model with a placeholder token per media item."""

    def __init__(self, model_dir: Path, config: PretrainedConfig) -> None:
        self.image_token_id = int(config.image_token_id)
        text_config = config.get_text_config()
        self.hidden_size = int(text_config.hidden_size)
        self.vocab_size = int(text_config.vocab_size)
        self.max_position_embeddings = int(text_config.max_position_embeddings)
        # The KV cache's shape, checked when one arrives from another worker.
        self.num_hidden_layers = int(text_config.num_hidden_layers)
        self.num_key_value_heads = int(text_config.num_key_value_heads)
        heads = int(text_config.num_attention_heads)
        self.head_dim = int(getattr(text_config, "head_dim", None) or self.hidden_size // heads)

    def expand_placeholders(self, token_ids: list[int], num_tokens: list[int]) -> list[int]:
        """Replace the i-th media placeholder with num_tokens[i] copies of it."""
        out: list[int] = []
        item = 0
        for tok in token_ids:
            if tok == self.image_token_id:
                if item >= len(num_tokens):
                    raise ValueError(f"prompt has more image placeholders than the {len(num_tokens)} images given")
                out.extend([tok] * num_tokens[item])
                item += 1
            else:
                out.append(tok)
        if item != len(num_tokens):
            raise ValueError(f"prompt has {item} image placeholders but {len(num_tokens)} images were given")
        return out

    @torch.inference_mode()
    def embed_prompt(self, model: Any, token_ids: list[int], media_embeds: list[torch.Tensor]) -> torch.Tensor:
        """Token embeddings [1, L, hidden] with media embeddings scattered over the placeholders."""
        ids = torch.tensor([token_ids], dtype=torch.long, device=model.device)
        embeds = model.get_input_embeddings()(ids)
        if media_embeds:
            feats = torch.cat(media_embeds, dim=0).to(embeds.device, embeds.dtype)
            mask = (ids == self.image_token_id).unsqueeze(-1).expand_as(embeds)
            embeds = embeds.masked_scatter(mask, feats)
        return embeds

    @torch.inference_mode()
    def forward(
        self,
        model: Any,
        positions: torch.Tensor,
        cache: Any,
        *,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Any]:
        """Run the language model over new tokens; return (last-token logits [vocab], cache).

        ``positions`` are in the layout the model's forward takes. Explicit
        positions keep a model from computing them from state of its own
        (Qwen-VL's ``rope_deltas``), which is per model instance, not per sequence.
        """
        out = model(
            input_ids=input_ids,
            inputs_embeds=inputs_embeds,
            position_ids=positions.to(model.device),
            use_cache=True,
            logits_to_keep=1,
            **{cache_kwarg(model.__class__): cache},
        )
        new_cache = getattr(out, "cache", None)
        if new_cache is None:
            new_cache = out.past_key_values
        return out.logits[0, -1], new_cache


@functools.cache
def cache_kwarg(model_class: Any) -> str:
    # transformers 5.24 renamed the forward's `past_key_values` to `cache` (the
    # old name warns until 5.40); 5.17 only knows `past_key_values`.
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def features_per_item(out: Any, counts: list[int]) -> list[torch.Tensor]:
    """Per-item features of a ``get_image_features`` call: 5.24 returns a
    BaseModelOutputWithPooling whose pooler_output holds the per-item split;
    older releases returned the split, or one tensor to split."""
    feats = out.pooler_output if hasattr(out, "pooler_output") else out
    if isinstance(feats, torch.Tensor):
        return list(torch.split(feats.reshape(-1, feats.shape[-1]), counts))
    return [f.reshape(-1, f.shape[-1]) for f in feats]
