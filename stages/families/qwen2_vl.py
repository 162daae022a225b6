"""Qwen2-VL and Qwen2.5-VL: image and video preprocessing, the vision tower
calls and M-RoPE positions.

The engine drives the Hugging Face model class itself; this adapter only
feeds it what ``generate()`` would: the same token embeddings with the media
embeddings scattered in, the same 3-D (temporal, height, width) positions,
one forward over the whole prompt, then one forward per new token. That is
what makes greedy tokens identical to ``generate()``. Qwen2.5-VL differs in
its vision tower (window attention), which its model class owns, and in
spacing a video's temporal positions by seconds.

Video frames go through the PIL image processor one by one and are then
grouped in pairs (``temporal_patch_size``) into the layout of Hugging Face's
video processor, which needs torchvision (see FACTS.md): the same patches,
except that frames are resized by PIL's bicubic filter, not torchvision's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from PIL import Image

try:  # transformers >= 5.x ships the PIL and torchvision backends as two classes.
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil as _ImageProcessor,
    )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as _smart_resize
except ImportError:  # older releases: Qwen2VLImageProcessor is the PIL/numpy one
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import (  # type: ignore[assignment]
        Qwen2VLImageProcessor as _ImageProcessor,
    )
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as _smart_resize
from transformers import PretrainedConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

try:  # 5.17 on: a vision forward takes these precomputed (what makes it capturable)
    from transformers import vision_utils as _vision_utils
except ImportError:  # pragma: no cover - older transformers: the tower runs eagerly
    _vision_utils = None  # type: ignore[assignment]

from schemas.processed import MediaKind
from stages import compiled
from stages.compute_threads import helper_pool
from stages.device_copy import tensor_on, to_device
from stages.families import vision_attention
from stages.families.base import (
    Grid,
    LanguageModelFamily,
    Media,
    MediaEmbedding,
    PreparedImage,
    encode_by_kind,
    features_per_item,
)
from stages.media import DecodedVideo

# Keys of a video_preprocessor_config.json that size the frames.
_VIDEO_SIZE_KEYS = ("size", "min_pixels", "max_pixels")


def video_frame_patches(
    processor: Any, frames: list[Image.Image], temporal_patch_size: int
) -> tuple[torch.Tensor, Grid]:
    """One video's pixel patches [t*h*w, C*T*P*P] and grid (t, h, w) in the
    layout of Qwen's video processor, from the PIL image processor.

    The image processor turns each frame into patches whose temporal slots
    all hold that frame; a video patch holds T consecutive frames instead,
    so the first slot of each frame's patches is kept and T frames are
    stacked into one patch. The last frame is repeated up to a multiple of T,
    as the video processor does.
    """
    frames = list(frames)
    while len(frames) % temporal_patch_size:
        frames.append(frames[-1])
    out = processor(images=frames, return_tensors="pt")
    pixels, grids = out["pixel_values"], out["image_grid_thw"]
    if len({tuple(g) for g in grids.tolist()}) != 1:
        raise ValueError("video frames of different sizes")
    _, gh, gw = (int(x) for x in grids[0].tolist())
    f, n, tp = len(frames), gh * gw, temporal_patch_size
    area = int(processor.patch_size) ** 2
    channels = pixels.shape[1] // (tp * area)
    # [F, N, C, T, P*P] -> each frame once: [F, N, C, P*P] -> T frames a patch: [F/T, N, C, T, P*P]
    single = pixels.view(f, n, channels, tp, area)[:, :, :, 0]
    grouped = single.view(f // tp, tp, n, channels, area).permute(0, 2, 3, 1, 4)
    return grouped.reshape(f // tp * n, channels * tp * area), (f // tp, gh, gw)


_POOL: ThreadPoolExecutor | None = None


def _joined(prepared: list[PreparedImage]) -> tuple[torch.Tensor, torch.Tensor]:
    """Images prepared one by one, as the processor's output for all of them
    (it treats each on its own and concatenates)."""
    return torch.cat([p.pixel_values for p in prepared]), torch.cat([p.grid for p in prepared])


def _preprocess_pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = helper_pool("preprocess", max_workers=min(8, os.cpu_count() or 1))
    return _POOL


class Qwen2VLFamily(LanguageModelFamily):
    name: ClassVar[str] = "qwen2_vl"
    architectures: ClassVar[tuple[str, ...]] = ("Qwen2VLForConditionalGeneration",)
    _model_class: ClassVar[Any] = Qwen2VLForConditionalGeneration
    # Qwen2.5-VL's tower also windows its attention by values of the grid
    # that transformers does not take precomputed the same way: eager there.
    graphed_tower: ClassVar[bool] = True

    def __init__(self, model_dir: Path, config: PretrainedConfig) -> None:
        super().__init__(model_dir, config)
        self.image_processor = _ImageProcessor.from_pretrained(str(model_dir))
        self.video_processor = _video_frame_processor(model_dir, self.image_processor)
        self.merge_size = int(config.vision_config.spatial_merge_size)
        self.temporal_patch_size = int(config.vision_config.temporal_patch_size)
        self.video_frame_multiple = self.video_frame_multiple_of(config)
        self._norm: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def placeholders_of(cls, config: PretrainedConfig) -> dict[MediaKind, int]:
        return {MediaKind.IMAGE: int(config.image_token_id), MediaKind.VIDEO: int(config.video_token_id)}

    @classmethod
    def video_frame_multiple_of(cls, config: PretrainedConfig) -> int:
        return int(config.vision_config.temporal_patch_size)

    @property
    def model_class(self) -> Any:
        return self._model_class

    # -- media --------------------------------------------------------------

    def preprocess(self, images: list[Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
        """pixel_values [patches, C*T*P*P] (float32) and image_grid_thw [n, 3].

        The processor treats each image on its own (resize, normalise,
        patchify) and concatenates: several images are processed on threads
        (PIL and numpy release the GIL), which gives the same tensors. On a
        GPU this CPU work is most of a small image's encode; serial, it would
        eat the gain of encoding several requests' images in one call."""
        return _joined(self._prepared(images))

    def _normalisation(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The processor's per-channel mean and std on ``device``, [C, 1, 1],
        made once (two copies up per image were a tenth of the engine
        thread's CPU under load)."""
        if device not in self._norm:
            proc = self.image_processor
            self._norm[device] = (
                tensor_on(proc.image_mean, device, torch.float32)[:, None, None],
                tensor_on(proc.image_std, device, torch.float32)[:, None, None],
            )
        return self._norm[device]

    def preprocess_on(
        self, images: list[Image.Image], device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``preprocess`` on ``device`` (pixel_values there in ``dtype``) for
        images the processor would not resize: their bytes go over once, and
        the rescale, normalisation and patches (a few ms of numpy on the host
        for a 448×448 image) are a handful of kernels. The processor's own
        arithmetic (a float64 rescale to float32, then per-channel mean and
        std in float32), so on the CPU it gives the processor's exact values.
        None where an image needs resizing or is not RGB: the processor's
        PIL resize then, whose filter the device does not reproduce."""
        proc = self.image_processor
        if not all(self._device_preprocesses(im) for im in images):
            return None
        mean, std = self._normalisation(device)
        patch, merge, temporal = int(proc.patch_size), int(proc.merge_size), int(proc.temporal_patch_size)
        outs, grids = [], []
        for im in images:
            pixels = to_device(torch.from_numpy(np.array(im)), device).permute(2, 0, 1)  # [C, H, W] uint8
            x = ((pixels.double() * float(proc.rescale_factor)).float() - mean) / std
            channels, height, width = x.shape
            gh, gw = height // patch, width // patch
            x = x.reshape(channels, gh // merge, merge, patch, gw // merge, merge, patch).permute(1, 4, 2, 5, 0, 3, 6)
            x = x[:, :, :, :, :, None].expand(*x.shape[:5], temporal, patch, patch)
            outs.append(x.reshape(gh * gw, channels * temporal * patch * patch))
            grids.append([1, gh, gw])
        return torch.cat(outs).to(dtype), torch.tensor(grids, dtype=torch.long)

    def _device_preprocesses(self, im: Image.Image) -> bool:
        """Whether ``preprocess_on`` takes this image (RGB, not resized)."""
        proc = self.image_processor
        if not (proc.do_rescale and proc.do_normalize) or im.mode != "RGB":
            return False
        size = proc.size
        factor = int(proc.patch_size) * int(proc.merge_size)
        target = _smart_resize(im.height, im.width, factor, size["shortest_edge"], size["longest_edge"])
        return tuple(target) == (im.height, im.width)

    def prepare(self, media: list[Media], device: torch.device) -> list[Media]:
        """Images the device will not preprocess go through the processor
        here, one by one (it treats each on its own), off the engine's thread."""
        on_device = device.type == "cuda"
        wanted = [isinstance(m, Image.Image) and not (on_device and self._device_preprocesses(m)) for m in media]
        done = iter(self._prepared([m for m, w in zip(media, wanted, strict=True) if w and isinstance(m, Image.Image)]))
        return [next(done) if w else m for m, w in zip(media, wanted, strict=True)]

    def _prepared(self, images: Sequence[Image.Image | PreparedImage]) -> list[PreparedImage]:
        """Each image through the processor alone (several on threads: PIL
        and numpy release the GIL), the prepared ones as they are."""
        todo = [im for im in images if isinstance(im, Image.Image)]

        def one(im: Image.Image) -> PreparedImage:
            out = self.image_processor(images=[im], return_tensors="pt")
            return PreparedImage(out["pixel_values"], out["image_grid_thw"])

        done = iter(list(_preprocess_pool().map(one, todo)) if len(todo) > 1 else [one(im) for im in todo])
        return [im if isinstance(im, PreparedImage) else next(done) for im in images]

    def on_loaded(self, model: Any, device: torch.device, dtype: torch.dtype) -> None:
        if vision_attention.available(device, dtype):
            vision_attention.use_packed_attention(model.model.visual.config)

    def compile_tower(self, model: Any) -> None:
        """Each vision block through torch.compile, with dynamic shapes (one
        compilation for every grid): its norms, QuickGELU and the rotary
        embedding's float32 arithmetic fused, 382 kernels a 448×448 image
        instead of 894; graphed, 4.8 ms of the GPU against 7.4 (2B preset,
        H100, 2026-11-28). Compiled now, on a small blank image, so that no
        request waits for it (a few seconds)."""
        if not self.graphed_tower:
            return
        for block in model.model.visual.blocks:
            block.compile(**compiled.OPTIONS)
        side = int(model.config.vision_config.patch_size) * self.merge_size * 4
        with torch.inference_mode():
            self._encode_images(model, [Image.new("RGB", (side, side))])

    def num_image_tokens(self, grid: Grid) -> int:
        t, h, w = grid
        return t * h * w // (self.merge_size**2)

    def num_tokens(self, item: MediaEmbedding) -> int:
        return self.num_image_tokens(item.grid_thw)

    def embeddings_grid(self, grid: Grid, rows: int) -> Grid:
        if len(grid) != 3:
            raise ValueError("Qwen-VL embeddings need their 'grid' (t, h, w): positions depend on it")
        if grid[1] % self.merge_size or grid[2] % self.merge_size or self.num_image_tokens(grid) != rows:
            raise ValueError(f"grid {list(grid)} does not give {rows} tokens with spatial merge {self.merge_size}")
        return grid

    @torch.inference_mode()
    def encode(self, model: Any, media: list[Media]) -> list[MediaEmbedding]:
        return encode_by_kind(
            media,
            {
                MediaKind.IMAGE: lambda images: self._encode_images(model, images),
                MediaKind.VIDEO: lambda videos: self._encode_videos(model, videos),
            },
            self.name,
        )

    def _encode_images(self, model: Any, images: list[Image.Image | PreparedImage]) -> list[MediaEmbedding]:
        device = model.device
        raw = [im for im in images if isinstance(im, Image.Image)]
        # The CPU keeps the processor: generate()'s exact inputs, whatever the image.
        on_device = None
        if device.type == "cuda" and len(raw) == len(images):
            on_device = self.preprocess_on(raw, device, model.dtype)
        if on_device is not None:
            pixels, grid = on_device
        else:
            pixel_values, grid = _joined(self._prepared(images))
            pixels = to_device(pixel_values, device, model.dtype)
        grids: list[Grid] = [(int(t), int(h), int(w)) for t, h, w in grid.tolist()]
        counts = [self.num_image_tokens(g) for g in grids]
        if self.graphed_tower and self.tower_graphs.enabled and device.type == "cuda" and _vision_utils is not None:
            feats = list(torch.split(self._graphed_tower(model, pixels, grid), counts))
        else:
            feats = features_per_item(model.get_image_features(pixels, to_device(grid, device)), counts)
        return [MediaEmbedding(f, g, MediaKind.IMAGE) for f, g in zip(feats, grids, strict=True)]

    def _graphed_tower(self, model: Any, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        """The tower's merged features [tokens, hidden] through a CUDA graph
        of these grids: what depends on the grid's values (rotary positions,
        attention segments and their longest) is computed here, on the host,
        and handed in the way transformers takes precomputed values, so the
        forward reads nothing back from the GPU."""
        assert _vision_utils is not None
        visual = model.model.visual
        device = pixels.device
        cu_seqlens = _vision_utils.get_vision_cu_seqlens(grid)
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        position_ids = _vision_utils.get_vision_position_ids(grid, self.merge_size)

        def tower(pixel_values: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
            out = visual(
                pixel_values, grid_thw=grid, position_ids=position_ids, cu_seqlens=cu_seqlens, max_seqlen=longest
            )
            merged: torch.Tensor = out.pooler_output if hasattr(out, "pooler_output") else out
            return merged

        inputs = {
            "pixel_values": pixels,
            "position_ids": to_device(position_ids, device),
            "cu_seqlens": to_device(cu_seqlens, device),
        }
        return self.tower_graphs(("image", tuple(map(tuple, grid.tolist()))), tower, inputs)

    def _encode_videos(self, model: Any, videos: list[DecodedVideo]) -> list[MediaEmbedding]:
        patches = [video_frame_patches(self.video_processor, v.frames, self.temporal_patch_size) for v in videos]
        pixel_values = torch.cat([p for p, _ in patches])
        grids = [g for _, g in patches]
        device = model.device
        out = model.get_video_features(
            pixel_values_videos=to_device(pixel_values, device, model.dtype),
            video_grid_thw=tensor_on(grids, device, torch.long),
        )
        feats = features_per_item(out, [self.num_image_tokens(g) for g in grids])
        return [
            MediaEmbedding(f, g, MediaKind.VIDEO, seconds_per_grid=self.temporal_patch_size / v.fps)
            for f, g, v in zip(feats, grids, videos, strict=True)
        ]

    # -- positions ------------------------------------------------------------

    def temporal_positions(self, item: MediaEmbedding) -> torch.Tensor:
        """Temporal index of each of an item's grid steps (before the offset)."""
        return torch.arange(item.grid_thw[0])

    def prompt_positions(self, token_ids: list[int], media: Sequence[MediaEmbedding]) -> tuple[torch.Tensor, int]:
        """M-RoPE positions [3, 1, L] of an expanded prompt, and its rope delta.

        Text tokens advance all three rows together; a media block gets
        (t, h, w) grid coordinates offset by the position it starts at, and
        the text after it resumes at start + max(h, w) of the merged grid
        (transformers 5.17 to 5.24 leave the temporal extent out). The delta
        (max position + 1 - L) shifts every later, text-only position. Items
        are assigned in order by their token counts, so two adjacent items
        stay two items.
        """
        n = len(token_ids)
        positions = torch.empty(3, n, dtype=torch.long)
        placeholders = set(self.placeholder_ids.values())
        is_media = [t in placeholders for t in token_ids]
        cur = i = item = 0
        top = -1
        while i < n:
            if is_media[i]:
                t, h, w = media[item].grid_thw
                gh, gw = h // self.merge_size, w // self.merge_size
                count = t * gh * gw
                tt = self.temporal_positions(media[item]).repeat_interleave(gh * gw)
                hh = torch.arange(gh).repeat_interleave(gw).repeat(t)
                ww = torch.arange(gw).repeat(t * gh)
                block = torch.stack([tt, hh, ww]) + cur
                positions[:, i : i + count] = block
                top = max(top, int(block.max()))
                cur += max(gh, gw)
                i += count
                item += 1
            else:
                j = i
                while j < n and not is_media[j]:
                    j += 1
                positions[:, i:j] = torch.arange(j - i) + cur
                top = max(top, cur + j - i - 1)
                cur += j - i
                i = j
        return positions.unsqueeze(1), top + 1 - n

    def decode_positions(self, position: int) -> torch.Tensor:
        # After the prompt every token is text: the same position in all three rows.
        return torch.full((3, 1, 1), position, dtype=torch.long)


class Qwen25VLFamily(Qwen2VLFamily):
    name: ClassVar[str] = "qwen2_5_vl"
    architectures: ClassVar[tuple[str, ...]] = ("Qwen2_5_VLForConditionalGeneration",)
    _model_class: ClassVar[Any] = Qwen2_5_VLForConditionalGeneration
    graphed_tower: ClassVar[bool] = False

    def __init__(self, model_dir: Path, config: PretrainedConfig) -> None:
        super().__init__(model_dir, config)
        self.tokens_per_second = config.vision_config.tokens_per_second

    def temporal_positions(self, item: MediaEmbedding) -> torch.Tensor:
        # A video's grid steps sit tokens_per_second * seconds apart; the
        # arithmetic is transformers 5.24's (float32, then truncated).
        # transformers 5.17 truncated the seconds to an integer first: the
        # two agree whenever a grid step is a whole number of seconds (the
        # default 2 fps sampling with temporal_patch_size 2).
        steps = torch.arange(item.grid_thw[0])
        if item.kind is not MediaKind.VIDEO:
            return steps
        interval = self.tokens_per_second * torch.tensor(item.seconds_per_grid, dtype=torch.float32)
        return (steps * interval).long()


def _video_frame_processor(model_dir: Path, image_processor: Any) -> Any:
    """The image processor sized as the checkpoint's video processor (its
    video_preprocessor_config.json), or the image processor itself."""
    path = model_dir / "video_preprocessor_config.json"
    if not path.is_file():
        return image_processor
    config = json.loads(path.read_text())
    overrides = {key: config[key] for key in _VIDEO_SIZE_KEYS if key in config}
    return _ImageProcessor.from_pretrained(str(model_dir), **overrides) if overrides else image_processor
