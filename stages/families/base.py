"""What every model family adapter provides, and what most of them share.

The engine is generic: it asks the family how a checkpoint takes its media
(preprocessing, the encoder, how many tokens each item becomes), how the
prompt's positions are laid out (M-RoPE for Qwen-VL, plain 1-D elsewhere)
and how the language model is called. A family that runs the Hugging Face
model class the way ``generate()`` does gives the same tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch
from PIL import Image
from transformers import PretrainedConfig

from schemas.errors import UnsupportedMedia
from schemas.processed import MediaKind
from stages.device_copy import tensor_on, to_device
from stages.families.tower_graphs import TowerGraphs
from stages.media import DecodedAudio, DecodedVideo

# Grid of one encoded item, as the family needs it for positions (Qwen-VL:
# the (t, h, w) patch grid before the merge); carried from encode to prefill.
Grid = tuple[int, ...]


# A decoded media item as the encoder takes it.
@dataclasses.dataclass(frozen=True)
class PreparedImage:
    """An image already through its family's processor (``Family.prepare``):
    what the tower takes, made off the engine's thread."""

    pixel_values: torch.Tensor  # the processor's output for this image alone
    grid: torch.Tensor  # [1, 3]: its (t, h, w) in patches


# Media as decoded from their bytes; and as an encoder takes them.
Decoded = Image.Image | DecodedVideo | DecodedAudio
Media = Decoded | PreparedImage


def kind_of(item: Media) -> MediaKind:
    if isinstance(item, DecodedVideo):
        return MediaKind.VIDEO
    if isinstance(item, DecodedAudio):
        return MediaKind.AUDIO
    return MediaKind.IMAGE


@dataclasses.dataclass
class MediaEmbedding:
    """Encoder output for one media item: what encode gives and prefill takes."""

    embeddings: torch.Tensor  # [num_tokens, text_hidden]
    grid_thw: Grid  # the family's layout of the item (Qwen-VL: patch grid before the merge)
    kind: MediaKind = MediaKind.IMAGE
    # Qwen2.5-VL video: seconds of video one temporal grid step spans
    # (temporal_patch_size / sampled fps); its temporal positions scale with it.
    seconds_per_grid: float = 0.0
    # The content digest of the item's bytes (and of how they were read): what
    # a prompt's KV blocks showing it are cached under. Empty: unknown, so the
    # blocks from its first on are not cached.
    digest: str = ""
    # False: the encoder did not run. The item's tokens were in the prefix
    # cache when its prompt was looked up, so prefill reads their keys and
    # values from there; ``embeddings`` are zeros of the right shape that no
    # forward reads (prefill raises MediaNotEncoded where the blocks went).
    encoded: bool = True

    @property
    def num_tokens(self) -> int:
        return int(self.embeddings.shape[0])


class Family(Protocol):
    name: ClassVar[str]
    architectures: ClassVar[tuple[str, ...]]
    # The placeholder token of each media kind this adapter runs for the checkpoint.
    placeholder_ids: dict[MediaKind, int]
    vocab_size: int
    max_position_embeddings: int
    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int
    # Frames a sampled video is padded to a multiple of (Qwen-VL: temporal_patch_size).
    video_frame_multiple: int

    hidden_size: int
    # The vision tower's CUDA graphs, where the family's tower can be replayed (set by the engine on a GPU).
    tower_graphs: TowerGraphs

    def __init__(self, model_dir: Path, config: PretrainedConfig) -> None: ...

    @classmethod
    def placeholders_of(cls, config: PretrainedConfig) -> dict[MediaKind, int]: ...

    @classmethod
    def video_frame_multiple_of(cls, config: PretrainedConfig) -> int: ...

    @property
    def model_class(self) -> Any: ...

    def on_loaded(self, model: Any, device: torch.device, dtype: torch.dtype) -> None: ...

    def compile_tower(self, model: Any) -> None:
        """On a GPU: compile the encoder's layers where that is known to
        help, and compile them now rather than in a request."""
        ...

    def prepare(self, media: list[Media], device: torch.device) -> list[Media]:
        """The CPU work on decoded media that needs no model (an image
        processor's resize and normalisation), on whatever thread calls it,
        so the engine's thread does not; ``encode`` takes what it returns."""
        ...

    def encode(self, model: Any, media: list[Media]) -> list[MediaEmbedding]:
        """Embeddings of a request's media, in order: one tower call per kind,
        as generate() makes them."""
        ...

    def num_tokens(self, item: MediaEmbedding) -> int:
        """The token count an item of this grid must have."""
        ...

    def embeddings_grid(self, grid: Grid, rows: int) -> Grid:
        """The grid of precomputed embeddings of ``rows`` tokens, from what the
        payload gave (``()`` if nothing); raises ValueError if they cannot fit."""
        ...

    def expand_placeholders(self, token_ids: list[int], media: Sequence[MediaEmbedding]) -> list[int]: ...

    def prompt_positions(self, token_ids: list[int], media: Sequence[MediaEmbedding]) -> tuple[torch.Tensor, int]: ...

    def decode_positions(self, position: int) -> torch.Tensor: ...

    def embed_prompt(self, model: Any, token_ids: list[int], media: Sequence[MediaEmbedding]) -> torch.Tensor: ...

    def forward(
        self,
        model: Any,
        positions: torch.Tensor,
        cache: Any,
        *,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        all_logits: bool = False,
    ) -> tuple[torch.Tensor, Any]: ...


class LanguageModelFamily:
    """The parts shared by families whose language model is a decoder-only
    Hugging Face model with a placeholder token per media item."""

    name: ClassVar[str]

    video_frame_multiple = 1

    def __init__(self, model_dir: Path, config: PretrainedConfig) -> None:
        self.placeholder_ids = self.placeholders_of(config)
        text_config = config.get_text_config()
        self.hidden_size = int(text_config.hidden_size)
        self.vocab_size = int(text_config.vocab_size)
        self.max_position_embeddings = int(text_config.max_position_embeddings)
        # The KV cache's shape, checked when one arrives from another worker.
        self.num_hidden_layers = int(text_config.num_hidden_layers)
        self.num_key_value_heads = int(text_config.num_key_value_heads)
        heads = int(text_config.num_attention_heads)
        self.head_dim = int(getattr(text_config, "head_dim", None) or self.hidden_size // heads)
        # The engine sets these on a GPU; a family whose tower can replay them uses them.
        self.tower_graphs = TowerGraphs(0)

    def on_loaded(self, model: Any, device: torch.device, dtype: torch.dtype) -> None:
        """Adjust the loaded model for where it runs (a faster kernel that
        keeps its arithmetic); nothing by default."""

    def compile_tower(self, model: Any) -> None:
        """Nothing by default: a tower is compiled where it was measured to gain."""

    def prepare(self, media: list[Media], device: torch.device) -> list[Media]:
        return media

    def embeddings_grid(self, grid: Grid, rows: int) -> Grid:
        raise ValueError(f"the {self.name} adapter takes no precomputed image embeddings")

    @classmethod
    def placeholders_of(cls, config: PretrainedConfig) -> dict[MediaKind, int]:
        """The placeholder token of each kind the adapter runs, read from a
        config alone (the processor has no weights)."""
        return {MediaKind.IMAGE: int(config.image_token_id)}

    @classmethod
    def video_frame_multiple_of(cls, config: PretrainedConfig) -> int:
        """``video_frame_multiple`` from a config alone (the processor decodes videos with --frontend-decode)."""
        return 1

    def expand_placeholders(self, token_ids: list[int], media: Sequence[MediaEmbedding]) -> list[int]:
        """Replace the i-th media placeholder with as many copies of it as media[i] has tokens."""
        kinds = {token: kind for kind, token in self.placeholder_ids.items()}
        out: list[int] = []
        item = 0
        for tok in token_ids:
            kind = kinds.get(tok)
            if kind is None:
                out.append(tok)
                continue
            if item >= len(media):
                raise ValueError(f"prompt has more media placeholders than the {len(media)} items given")
            if media[item].kind is not kind:
                raise ValueError(f"media placeholder {item} is for {kind.value}, the item is {media[item].kind.value}")
            out.extend([tok] * media[item].num_tokens)
            item += 1
        if item != len(media):
            raise ValueError(f"prompt has {item} media placeholders but {len(media)} items were given")
        return out

    @torch.inference_mode()
    def embed_prompt(self, model: Any, token_ids: list[int], media: Sequence[MediaEmbedding]) -> torch.Tensor:
        """Token embeddings [1, L, hidden] with media embeddings scattered over
        the placeholders. Each item's tokens are contiguous and in prompt order,
        so one scatter over every kind's placeholders is the per-kind scatters
        generate() does."""
        ids = tensor_on([token_ids], model.device, torch.long)
        embeds = model.get_input_embeddings()(ids)
        if media:
            feats = torch.cat([m.embeddings for m in media], dim=0).to(embeds.device, embeds.dtype)
            placeholders = tensor_on(sorted(self.placeholder_ids.values()), ids.device, torch.long)
            mask = torch.isin(ids, placeholders).unsqueeze(-1).expand_as(embeds)
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
        all_logits: bool = False,
    ) -> tuple[torch.Tensor, Any]:
        """Run the language model over new tokens; return (last-token logits
        [vocab], or with ``all_logits`` every new token's [tokens, vocab], cache).

        ``positions`` are in the layout the model's forward takes. Explicit
        positions keep a model from computing them from state of its own
        (Qwen-VL's ``rope_deltas``), which is per model instance, not per sequence.
        """
        out = model(
            input_ids=input_ids,
            inputs_embeds=inputs_embeds,
            position_ids=to_device(positions, model.device),
            use_cache=True,
            logits_to_keep=0 if all_logits else 1,
            **{cache_kwarg(model.__class__): cache},
        )
        new_cache = getattr(out, "cache", None)
        if new_cache is None:
            new_cache = out.past_key_values
        return (out.logits[0] if all_logits else out.logits[0, -1]), new_cache

    def prompt_positions(self, token_ids: list[int], media: Sequence[MediaEmbedding]) -> tuple[torch.Tensor, int]:
        """Positions of an expanded prompt in the layout the model's forward
        takes, and the shift of every later position (plain 1-D here)."""
        return linear_positions(len(token_ids)), 0

    def decode_positions(self, position: int) -> torch.Tensor:
        return torch.tensor([[position]], dtype=torch.long)


def encode_by_kind(
    media: list[Media], encoders: dict[MediaKind, Callable[[list[Any]], list[MediaEmbedding]]], family: str
) -> list[MediaEmbedding]:
    """Run each kind's encoder once over that kind's items (generate() encodes
    a request's images in one call, its videos in another) and put the
    results back in request order."""
    kinds = [kind_of(m) for m in media]
    for kind in kinds:
        if kind not in encoders:
            raise UnsupportedMedia(f"{kind.value} input is not supported by the {family} adapter")
    results = {
        kind: iter(encode([m for m, k in zip(media, kinds, strict=True) if k is kind]))
        for kind, encode in encoders.items()
        if kind in kinds
    }
    return [next(results[kind]) for kind in kinds]


def linear_positions(length: int) -> torch.Tensor:
    """Plain 1-D positions [1, L] (every family but Qwen-VL)."""
    return torch.arange(length, dtype=torch.long).unsqueeze(0)


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
