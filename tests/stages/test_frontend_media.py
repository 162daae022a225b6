"""What --frontend-decode sends: a decoded item as a tensor and back is the
item the encoder's own decoding makes (pixels, frames and their timing,
samples), and a tensor that cannot be one is refused."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from schemas.errors import InvalidMedia
from schemas.processed import DecodedItem, MediaKind
from stages.media import MediaPolicy, VideoOptions, decode_audio, decode_image, decode_video
from stages.media.frontend import as_tensor, from_tensor
from tests.stages.test_media_av import encode_audio, encode_video

POLICY = MediaPolicy()


def _png(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (37, 53, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def test_an_image_comes_back_pixel_for_pixel() -> None:
    image = decode_image(_png(1), POLICY)
    tensor, item = as_tensor(image, "d1")
    assert (tensor.dtype, list(tensor.shape), item.kind, item.digest) == (
        torch.uint8,
        [37, 53, 3],
        MediaKind.IMAGE,
        "d1",
    )
    back = from_tensor(item, tensor)
    assert isinstance(back, Image.Image) and back.mode == "RGB"
    assert np.array_equal(np.asarray(back), np.asarray(image))


def test_a_video_comes_back_with_its_frames_and_timing() -> None:
    video = decode_video(
        encode_video(n=10, size=(48, 32), fps=5), POLICY, VideoOptions(num_frames=3, pad_to_multiple=2)
    )
    tensor, item = as_tensor(video, "d2")
    assert list(tensor.shape) == [4, 32, 48, 3]  # 3 frames padded to 4
    back = from_tensor(item, tensor)
    assert (back.timestamps, back.fps, back.duration_s) == (video.timestamps, video.fps, video.duration_s)  # type: ignore[union-attr]
    assert (back.frame_indices, back.total_frames, back.source_fps) == (  # type: ignore[union-attr]
        video.frame_indices,
        video.total_frames,
        video.source_fps,
    )
    for a, b in zip(back.frames, video.frames, strict=True):  # type: ignore[union-attr]
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_an_audio_clip_comes_back_sample_for_sample() -> None:
    audio = decode_audio(encode_audio("WAV", "PCM_16", rate=22_050, seconds=0.5), POLICY)
    tensor, item = as_tensor(audio, "d3")
    back = from_tensor(item, tensor)
    assert (back.sampling_rate, back.duration_s) == (16_000, audio.duration_s)  # type: ignore[union-attr]
    assert np.array_equal(back.samples, audio.samples)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("kind", "tensor"),
    [
        (MediaKind.IMAGE, torch.zeros(4, 4, 3, dtype=torch.float32)),
        (MediaKind.IMAGE, torch.zeros(4, 4, 4, dtype=torch.uint8)),
        (MediaKind.VIDEO, torch.zeros(4, 4, 3, dtype=torch.uint8)),
        (MediaKind.AUDIO, torch.zeros(2, 8, dtype=torch.float32)),
    ],
)
def test_a_tensor_that_cannot_be_its_kind_is_refused(kind: MediaKind, tensor: torch.Tensor) -> None:
    with pytest.raises(InvalidMedia):
        from_tensor(DecodedItem(kind, "d"), tensor)


def test_a_video_whose_timestamps_do_not_match_its_frames_is_refused() -> None:
    with pytest.raises(InvalidMedia, match="timestamps"):
        from_tensor(DecodedItem(MediaKind.VIDEO, "d", timestamps=[0.0]), torch.zeros(2, 4, 4, 3, dtype=torch.uint8))
