"""mmpipe's encoder outputs as vLLM's prompt inputs, and vLLM's encoder-cache
connector (encoder-only vLLM on the ``encode`` role) as mmpipe sets it up.

Four ways a media item reaches vLLM's language model here (Qwen-VL's images
and videos, Qwen2-Audio's audio):

- an image mmpipe's encoder made: ``image_embeds`` + ``image_grid_thw``;
- a video mmpipe's encoder made: ``video_embeds`` + ``video_grid_thw``
  (vLLM places M-RoPE positions by the grid, as mmpipe's family does);
- an image vLLM encoder-only made (``RemoteEmbedding``): no tensor, only
  ``image_grid_thw`` (which sizes the placeholder) and the item's vLLM
  multimodal hash as its ``multi_modal_uuids`` entry; the engine, an
  ``ec_consumer``, finds the encoder output by that hash in the connector's
  storage (``allow_missing_mm_embeddings``, which vLLM derives for an EC
  consumer);
- an audio mmpipe's encoder made: ``audio_embeds``, a list of one
  ``[tokens, hidden]`` tensor per audio (one tensor of all rows would be
  read as that many audios). vLLM encoder-only does not encode audio
  (``encoder_only`` refuses it with ``UnsupportedMedia``, 422).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch

from schemas.errors import TensorGone, UnsupportedMedia
from schemas.processed import EncodedItem, MediaItem, MediaKind, ProcessedRequest, VllmEncoded
from stages.families import MediaEmbedding

# vLLM's ExampleConnector for encoder outputs: safetensors files in a folder
# every encode and prefill worker of a deployment sees.
EC_CONNECTOR = "ECExampleConnector"
_KEYS = {
    MediaKind.IMAGE: ("image", "image_embeds", "image_grid_thw"),
    MediaKind.VIDEO: ("video", "video_embeds", "video_grid_thw"),
}


@dataclasses.dataclass
class RemoteEmbedding(MediaEmbedding):
    """An item whose encoder output waits in the EC connector under
    ``mm_hash``: ``embeddings`` is an empty ``[num_tokens, 0]`` tensor that
    only carries the token count (the checks on prompt length read it)."""

    mm_hash: str = ""


def mm_prompt(prompt_token_ids: list[int], media: list[MediaEmbedding], timed_video: bool = False) -> dict[str, Any]:
    """vLLM's prompt: ``prompt_token_ids`` hold one placeholder per item,
    which vLLM expands to the item's tokens by its grid. ``timed_video``: the
    checkpoint places video positions by time (Qwen2.5-VL)."""
    prompt: dict[str, Any] = {"prompt_token_ids": list(prompt_token_ids)}
    if not media:
        return prompt
    data: dict[str, dict[str, Any]] = {}
    uuids: dict[str, list[str]] = {}
    for kind in (MediaKind.IMAGE, MediaKind.VIDEO):
        items = [m for m in media if m.kind is kind]
        if not items:
            continue
        modality, embeds_key, grid_key = _KEYS[kind]
        entry: dict[str, Any] = {grid_key: torch.tensor([list(m.grid_thw) for m in items], dtype=torch.long)}
        remote = [m for m in items if isinstance(m, RemoteEmbedding)]
        if remote and len(remote) != len(items):
            raise ValueError("a request's items are encoded by one encoder: all remote or none")
        if remote:
            uuids[modality] = [m.mm_hash for m in remote]
        else:
            # One tensor of all items' rows, one grid row each (vLLM splits it by the grids).
            entry[embeds_key] = torch.cat([m.embeddings for m in items]) if len(items) > 1 else items[0].embeddings
        data[modality] = entry
    if timed_video and any(m.kind is MediaKind.VIDEO for m in media):
        # Qwen2.5-VL times its video positions by second_per_grid_ts, which
        # vLLM 0.32 does not read from video_embeds inputs (it takes 1.0):
        # refused rather than answered with other positions than generate()'s.
        raise UnsupportedMedia("the vLLM engine takes Qwen2-VL videos; Qwen2.5-VL videos lose their frame timing")
    audios = [m for m in media if m.kind is MediaKind.AUDIO]
    if any(isinstance(m, RemoteEmbedding) for m in audios):
        raise UnsupportedMedia("vLLM encoder-only encodes images, not audio: the built-in encoder takes audio")
    if audios:
        # One tensor per audio: a single [rows, hidden] tensor is taken as rows audios.
        data["audio"] = {"audio_embeds": [m.embeddings for m in audios]}
    prompt["multi_modal_data"] = data
    if uuids:
        prompt["multi_modal_uuids"] = uuids
    return prompt


# -- encoder-only vLLM: the encoder-cache connector ------------------------------


def ec_transfer_config(producer: bool, path: Path | str) -> dict[str, Any]:
    """vLLM's ``ec_transfer_config``: the encode worker's vLLM is the
    producer (vLLM then runs encoder-only, ``mm_encoder_only``), the
    prefill worker's the consumer; both name the same folder."""
    return {
        "ec_connector": EC_CONNECTOR,
        "ec_role": "ec_producer" if producer else "ec_consumer",
        "ec_connector_extra_config": {"shared_storage_path": str(path)},
    }


def ec_file(path: Path | str, mm_hash: str) -> Path:
    """Where ECExampleConnector keeps one item's encoder output (its own layout)."""
    return Path(path) / mm_hash / "encoder_cache.safetensors"


def remote_media(req: ProcessedRequest, path: Path | str | None) -> list[MediaEmbedding]:
    """The items of a request that vLLM encoder-only encoded, for a vLLM
    prefill that is the connector's consumer. A missing file (another
    folder, or cleaned up) is ``TensorGone``: the request runs again from its
    first hop, which writes it again."""
    encoded = req.vllm_encoded
    assert encoded is not None
    if path is None:
        raise UnsupportedMedia(
            "this vLLM prefill worker has no encoder-cache folder (--vllm-ec-path) for a vLLM encoder's outputs"
        )
    if not (len(encoded.mm_hashes) == len(encoded.items) == len(req.media)):
        raise ValueError(f"{len(encoded.mm_hashes)} keys for {len(encoded.items)} items and {len(req.media)} media")
    for mm_hash in encoded.mm_hashes:
        try:
            touch_ec_file(path, mm_hash)
        except FileNotFoundError:
            raise TensorGone(f"the encoder output {mm_hash} is not in {path}") from None
    return remote_embeddings(encoded, req.media)


def touch_ec_file(path: Path | str, mm_hash: str) -> None:
    """Mark an item's encoder output as used now: the folder's pruner
    (storage.py) deletes what has not changed for its TTL, and vLLM reads an
    output it finds again without writing it."""
    os.utime(ec_file(path, mm_hash))


def remote_embeddings(encoded: VllmEncoded, media: list[MediaItem]) -> list[MediaEmbedding]:
    """One ``RemoteEmbedding`` per item of ``encoded`` (keys and grids)."""
    return [
        RemoteEmbedding(torch.empty(item.num_tokens, 0), tuple(item.grid_thw), m.kind, mm_hash=mm_hash)
        for mm_hash, item, m in zip(encoded.mm_hashes, encoded.items, media, strict=True)
    ]


def encoded_items(ec_transfer_params: dict[str, Any], count: int, merge: int) -> VllmEncoded:
    """What vLLM's producer reported (``{mm_hash: {"item_indices": [...],
    "metadata": {"image_grid_thw": [t, h, w]}}}``) as one key and grid per
    item, in prompt order (an image given twice is one key at two indices)."""
    hashes: list[str | None] = [None] * count
    items: list[EncodedItem | None] = [None] * count
    for mm_hash, entry in ec_transfer_params.items():
        grid = [int(x) for x in entry["metadata"]["image_grid_thw"]]
        for index in entry["item_indices"]:
            hashes[index] = mm_hash
            items[index] = EncodedItem(num_tokens=grid[0] * grid[1] * grid[2] // (merge * merge), grid_thw=grid)
    if any(h is None for h in hashes):
        raise RuntimeError(f"vLLM's encoder reported {len(ec_transfer_params)} keys for {count} items")
    return VllmEncoded(mm_hashes=[h for h in hashes if h is not None], items=[i for i in items if i is not None])
