"""stages.media video and audio decoding, on media made here with PyAV and soundfile.

Video frames carry their own index as eight black/white stripes (bit 7 on the left), which
survives lossy codecs and scaling, so a test can tell exactly which frame it got.
"""

from __future__ import annotations

import base64
import io
import random
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from schemas.errors import InvalidMedia, InvalidRequest, TooLarge, UnsupportedMedia
from stages.media import (
    MediaFetcher,
    MediaPolicy,
    VideoOptions,
    decode_audio,
    decode_video,
    load_audio,
    load_audio_base64,
    load_video,
    sniff_audio,
    sniff_container,
)
from stages.media import audio as audio_mod
from stages.media import video as video_mod

POLICY = MediaPolicy()
FPS = 10
N_FRAMES = 26  # 2.6 s at 10 fps


def has_encoder(name: str) -> bool:
    try:
        av.codec.Codec(name, "w")
    except av.codec.codec.UnknownCodecError:
        return False
    return True


H264 = "libx264" if has_encoder("libx264") else "mpeg4"
VP9 = "libvpx-vp9" if has_encoder("libvpx-vp9") else "libvpx"


# -- making media ------------------------------------------------------------------------------


def stripes(i: int, size: tuple[int, int]) -> np.ndarray:
    """An RGB frame showing ``i`` (0-255) as 8 vertical stripes, white for a 1 bit."""
    width, height = size
    row = np.zeros(width, np.uint8)
    band = width // 8
    for bit in range(8):
        if i >> (7 - bit) & 1:
            row[bit * band : (bit + 1) * band] = 255
    return np.repeat(np.repeat(row[None, :, None], height, 0), 3, 2)


def frame_number(img: Image.Image) -> int:
    """Read back the index ``stripes`` drew."""
    arr = np.asarray(img.convert("L"), dtype=np.int32)
    band = img.width // 8
    middle = arr[:, : band * 8].reshape(img.height, 8, band)[:, :, band // 4 : band - band // 4]
    bits = middle.mean(axis=(0, 2)) > 128
    return int(sum(1 << (7 - b) for b in range(8) if bits[b]))


def encode_video(
    codec: str = H264,
    fmt: str = "mp4",
    n: int = N_FRAMES,
    size: tuple[int, int] = (64, 32),
    fps: int = FPS,
    gop: int | None = None,
    pts_ms: list[int] | None = None,
    rotation: int | None = None,
    frames: Callable[[int, tuple[int, int]], np.ndarray] = stripes,
    target: str | Path | None = None,
    options: dict[str, str] | None = None,
) -> bytes:
    """A video of ``n`` frames; ``pts_ms`` gives frame times in ms for variable frame rate."""
    buf: Any = io.BytesIO() if target is None else str(target)
    with av.open(buf, "w", format=fmt, options=options or {}) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        if gop is not None:
            stream.codec_context.gop_size = gop
        if pts_ms is not None:
            stream.codec_context.time_base = Fraction(1, 1000)
        if rotation is not None:
            stream.set_display_rotation(rotation)
        for i in range(n):
            frame = av.VideoFrame.from_ndarray(frames(i, size), format="rgb24")
            frame.pts, frame.time_base = (pts_ms[i], Fraction(1, 1000)) if pts_ms else (i, Fraction(1, fps))
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return buf.getvalue() if target is None else Path(target).read_bytes()


def sine(freq: float, rate: int, seconds: float, channels: int = 1) -> np.ndarray:
    t = np.arange(round(rate * seconds)) / rate
    wave = np.sin(2 * np.pi * freq * t).astype(np.float32)
    # Channel c at amplitude 1/(c+1): the mono mix is their mean.
    return np.stack([wave / (c + 1) for c in range(channels)], axis=1)


def encode_audio(fmt: str, subtype: str, rate: int = 44_100, seconds: float = 1.0, channels: int = 2) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, sine(440.0, rate, seconds, channels), rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def peak_hz(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(len(samples))))
    return float(np.fft.rfftfreq(len(samples), 1 / rate)[int(np.argmax(spectrum))])


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module")
def mp4() -> bytes:
    return encode_video()


@pytest.fixture(scope="module")
def webm() -> bytes:
    if not has_encoder(VP9):
        pytest.skip("this PyAV build has no VP8/VP9 encoder")
    return encode_video(VP9, "webm")


@pytest.fixture(scope="module")
def avi() -> bytes:
    return encode_video("mpeg4", "avi")


@pytest.fixture(params=["mp4", "webm", "avi"])
def video(request: pytest.FixtureRequest) -> bytes:
    data: bytes = request.getfixturevalue(request.param)
    return data


@pytest.fixture(scope="module")
def wav() -> bytes:
    return encode_audio("WAV", "PCM_16")


# -- video: sampling ---------------------------------------------------------------------------


def test_containers_are_sniffed(mp4: bytes, webm: bytes, avi: bytes) -> None:
    assert (sniff_container(mp4), sniff_container(webm), sniff_container(avi)) == ("mp4", "matroska", "avi")


def test_num_frames_picks_evenly_spaced_indices(video: bytes) -> None:
    out = decode_video(video, POLICY, VideoOptions(num_frames=4))
    # np.linspace(0, 25, 4).round() as the transformers video processors sample.
    assert out.frame_indices == [0, 8, 17, 25]
    assert [frame_number(f) for f in out.frames] == [0, 8, 17, 25]
    assert out.timestamps == pytest.approx([0.0, 0.8, 1.7, 2.5])
    assert out.duration_s == pytest.approx(2.6)
    assert out.fps == pytest.approx(4 / 2.6)
    assert (out.total_frames, out.source_fps) == (N_FRAMES, pytest.approx(FPS))
    assert all(f.mode == "RGB" and f.size == (64, 32) for f in out.frames)


def test_num_frames_beyond_the_video_gives_every_frame_once() -> None:
    out = decode_video(encode_video(n=6), POLICY, VideoOptions(num_frames=10))
    assert [frame_number(f) for f in out.frames] == [0, 1, 2, 3, 4, 5]


def test_fps_sampling(video: bytes) -> None:
    out = decode_video(video, POLICY, VideoOptions(fps=2))
    assert [frame_number(f) for f in out.frames] == [0, 5, 10, 15, 20, 25]
    assert out.timestamps == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0, 2.5])
    assert out.fps == 2.0


def test_default_fps_comes_from_the_policy(mp4: bytes) -> None:
    out = decode_video(mp4, MediaPolicy(video_default_fps=5.0), VideoOptions())
    assert out.frame_indices == list(range(0, 26, 2))
    assert out.fps == 5.0


def test_fps_sampling_is_capped_by_max_frames_and_spread_evenly(mp4: bytes) -> None:
    out = decode_video(mp4, POLICY, VideoOptions(fps=10, max_frames=5))
    # 26 sampling times, 5 kept: np.linspace(0, 25, 5).round() -> 0, 6, 12, 19, 25.
    assert [frame_number(f) for f in out.frames] == [0, 6, 12, 19, 25]
    assert out.fps == pytest.approx(5 / 2.6)
    capped = decode_video(mp4, MediaPolicy(video_max_frames=4), VideoOptions(fps=10))
    assert len(capped.frames) == 4


def test_fps_above_the_source_rate_does_not_repeat_frames(mp4: bytes) -> None:
    out = decode_video(mp4, POLICY, VideoOptions(fps=30))
    assert out.frame_indices == list(range(N_FRAMES))


def test_variable_frame_rate_is_sampled_by_time() -> None:
    data = encode_video(n=6, pts_ms=[0, 100, 200, 900, 1000, 1100])
    by_time = decode_video(data, POLICY, VideoOptions(fps=2))
    # At 0.5 s the frame shown since 0.2 s is still on screen.
    assert [frame_number(f) for f in by_time.frames] == [0, 2, 4]
    assert by_time.timestamps == pytest.approx([0.0, 0.2, 1.0])
    by_index = decode_video(data, POLICY, VideoOptions(num_frames=3))
    assert by_index.frame_indices == [0, 2, 5]


def test_pad_to_multiple_repeats_the_last_frame(mp4: bytes) -> None:
    out = decode_video(mp4, POLICY, VideoOptions(num_frames=3, pad_to_multiple=2))
    assert [frame_number(f) for f in out.frames] == [0, 12, 25, 25]
    assert out.frame_indices == [0, 12, 25, 25]
    assert out.timestamps == pytest.approx([0.0, 1.2, 2.5, 2.5])
    assert out.fps == pytest.approx(3 / 2.6)  # padding adds no time


def record_modes(modes: list[bool], read: Callable[..., list[Image.Image]]) -> Callable[..., list[Image.Image]]:
    """Wrap video._read_frames to record each call's ``seek`` flag."""

    def wrapper(*args: Any, seek: bool) -> list[Image.Image]:
        modes.append(seek)
        return read(*args, seek=seek)

    return wrapper


@pytest.mark.parametrize(("codec", "fmt"), [(H264, "mp4"), (VP9, "webm")])
def test_sampling_seeks_between_keyframes(monkeypatch: pytest.MonkeyPatch, codec: str, fmt: str) -> None:
    if not has_encoder(codec):
        pytest.skip(f"this PyAV build has no {codec} encoder")
    data = encode_video(codec, fmt, n=200, size=(32, 16), fps=25, gop=10)
    seeks: list[int] = []
    real = video_mod._seek_needed

    def spy(*args: Any) -> int | None:
        ts = real(*args)
        if ts is not None:
            seeks.append(ts)
        return ts

    monkeypatch.setattr(video_mod, "_seek_needed", spy)
    monkeypatch.setattr(video_mod, "_read_frames", record_modes(modes := [], video_mod._read_frames))
    out = decode_video(data, POLICY, VideoOptions(num_frames=7))
    assert [frame_number(f) for f in out.frames] == [0, 33, 66, 100, 133, 166, 199]
    assert len(seeks) >= 5
    assert modes == [True]  # every seek landed where it should: no fallback to decoding in order


def test_a_seek_that_overshoots_falls_back_to_decoding_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    data = encode_video(n=120, size=(32, 16), fps=25, gop=10)
    real = video_mod._seek_needed
    modes: list[bool] = []

    def past_the_target(keyframes: list[tuple[int, int]], position: int, target: int) -> int | None:
        # As a file with a lying index would: the seek lands after the wanted frame.
        return keyframes[-1][1] if real(keyframes, position, target) is not None else None

    monkeypatch.setattr(video_mod, "_seek_needed", past_the_target)
    monkeypatch.setattr(video_mod, "_read_frames", record_modes(modes, video_mod._read_frames))
    out = decode_video(data, POLICY, VideoOptions(num_frames=4))
    assert [frame_number(f) for f in out.frames] == [0, 40, 79, 119]
    assert modes == [True, False]


def test_display_rotation_is_applied() -> None:
    def left_white(i: int, size: tuple[int, int]) -> np.ndarray:
        arr = np.zeros((size[1], size[0], 3), np.uint8)
        arr[:, : size[0] // 2] = 255
        return arr

    out = decode_video(encode_video(n=2, rotation=90, frames=left_white), POLICY, VideoOptions(num_frames=1))
    img = out.frames[0].convert("L")
    # 90° counter-clockwise: 64x32 becomes 32x64 and the white left half ends up at the bottom.
    assert img.size == (32, 64)
    assert img.getpixel((16, 8)) < 60 and img.getpixel((16, 56)) > 200


def test_large_frames_are_scaled_down_keeping_aspect() -> None:
    data = encode_video(n=4, size=(192, 96))
    out = decode_video(data, MediaPolicy(video_max_pixels=64 * 32 + 100), VideoOptions(num_frames=4))
    for i, img in enumerate(out.frames):
        assert img.width * img.height <= 64 * 32 + 100
        assert img.width / img.height == pytest.approx(2, rel=0.05) and img.height >= 30
        assert frame_number(img) == i


# -- video: refusals ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_frames": 4, "fps": 2.0}, "not both"),
        ({"num_frames": 0}, "num_frames must be positive"),
        ({"fps": -1.0}, "fps must be positive"),
        ({"fps": float("nan")}, "fps must be positive"),
        ({"fps": 1e308}, "at most 1000"),
        ({"max_frames": 0}, "max_frames must be positive"),
    ],
)
def test_bad_sampling_options_are_invalid_requests(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidRequest, match=match):
        VideoOptions(**kwargs)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (VideoOptions(num_frames=33), "num_frames=33 is over the limit of 32"),
        (VideoOptions(max_frames=64), "max_frames=64"),
    ],
)
def test_frame_counts_over_the_cap_are_too_large(mp4: bytes, options: VideoOptions, match: str) -> None:
    with pytest.raises(TooLarge, match=match):
        decode_video(mp4, POLICY, options)


def test_video_duration_cap(video: bytes) -> None:
    with pytest.raises(TooLarge, match=r"2\.6s long, over the 2s limit"):
        decode_video(video, MediaPolicy(video_max_duration_s=2.0), VideoOptions(num_frames=2))


def test_oversized_frames_are_refused_before_decoding(mp4: bytes) -> None:
    with pytest.raises(TooLarge, match="64x32 = 2048 pixels, over the 2000 pixel limit"):
        decode_video(mp4, MediaPolicy(video_max_source_pixels=2000), VideoOptions(num_frames=2))


def test_video_byte_cap(mp4: bytes) -> None:
    with pytest.raises(TooLarge, match="byte limit"):
        decode_video(mp4, MediaPolicy(video_max_bytes=len(mp4) - 1), VideoOptions())


def test_truncated_video_is_invalid(mp4: bytes, webm: bytes, avi: bytes, tmp_path: Path) -> None:
    # moov (the index) at the end: cut it off. moov first (faststart): cut the frame data short.
    faststart = encode_video(target=tmp_path / "v.mp4", options={"movflags": "faststart"})
    assert faststart.find(b"moov") < faststart.find(b"mdat")
    for data in (mp4, faststart, webm, avi):
        with pytest.raises(InvalidMedia, match="truncated"):
            decode_video(data[: len(data) * 3 // 4], POLICY, VideoOptions(num_frames=4))


def test_packets_cut_short_are_invalid(tmp_path: Path) -> None:
    # Container sizes patched to match, as if the muxer had been wrong: FFmpeg flags the packet.
    data = bytearray(encode_video(target=tmp_path / "v.mp4", options={"movflags": "faststart"}))
    cut = len(data) * 3 // 4
    mdat = data.find(b"mdat") - 4
    data[mdat : mdat + 4] = (cut - mdat).to_bytes(4, "big")
    with pytest.raises(InvalidMedia, match="damaged packet"):
        decode_video(bytes(data[:cut]), POLICY, VideoOptions(num_frames=4))


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(random.Random(0).randbytes(4000), id="random-boxes"),
        # Box sizes that add up, so the bytes reach FFmpeg's parser.
        pytest.param((8 + 4000).to_bytes(4, "big") + b"moov" + random.Random(0).randbytes(4000), id="random-moov"),
    ],
)
def test_random_bytes_behind_an_mp4_header_are_invalid(body: bytes) -> None:
    data = b"\x00\x00\x00\x18ftypisom\x00\x00\x02\x00isomiso2" + body
    with pytest.raises(InvalidMedia):
        decode_video(data, POLICY, VideoOptions())


def test_an_absurd_frame_count_is_invalid_not_out_of_memory(mp4: bytes) -> None:
    # The stts box claims ~335 million entries: FFmpeg refuses to allocate them (ENOMEM), and
    # PyAV raises that as a MemoryError subclass. That is the file's fault, not the server's.
    data = bytearray(mp4)
    data[mp4.find(b"stts") + 8] = 0x14
    with pytest.raises(MemoryError):
        av.open(io.BytesIO(bytes(data)), format="mov")
    with pytest.raises(InvalidMedia, match="corrupt or truncated MP4/MOV video: Cannot allocate memory"):
        decode_video(bytes(data), POLICY, VideoOptions(num_frames=4))


@pytest.mark.parametrize("name", ["mp4", "webm", "avi"])
def test_damaged_video_only_ever_raises_media_errors(request: pytest.FixtureRequest, name: str) -> None:
    original: bytes = request.getfixturevalue(name)
    rng = random.Random(name)
    for _ in range(40):
        data = bytearray(original)
        for _ in range(rng.choice([1, 3, 10])):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            decode_video(bytes(data), POLICY, VideoOptions(num_frames=rng.choice([1, 4])))
        except (InvalidMedia, UnsupportedMedia, TooLarge):
            pass


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (
            b"\x89PNG\r\n\x1a\n" + bytes(100),
            "media is a PNG image; accepted video formats: MP4/MOV, WebM/Matroska, AVI",
        ),
        (b"FLV\x01\x05" + bytes(100), "media is FLV"),
        (b"", "not a recognised video"),
    ],
)
def test_other_formats_are_unsupported(data: bytes, match: str) -> None:
    with pytest.raises(UnsupportedMedia, match=match):
        decode_video(data, POLICY, VideoOptions())


def test_unusual_codecs_are_unsupported() -> None:
    data = encode_video("ffv1", "matroska", n=2)
    with pytest.raises(UnsupportedMedia, match="ffv1 video is not supported"):
        decode_video(data, POLICY, VideoOptions())


def test_audio_only_mp4_has_no_video() -> None:
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("aac", rate=16000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        frame.sample_rate, frame.pts = 16000, 0
        container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    with pytest.raises(InvalidMedia, match="no video stream"):
        decode_video(buf.getvalue(), POLICY, VideoOptions())


# -- video: loading ----------------------------------------------------------------------------


async def test_load_video_from_a_data_url(mp4: bytes) -> None:
    # The fetcher's global cap is far below the video; video_max_bytes is what counts for data:.
    async with MediaFetcher(MediaPolicy(max_bytes=100)) as fetcher:
        out = await load_video(data_url(mp4, "video/mp4"), fetcher, POLICY, VideoOptions(num_frames=2))
        assert [frame_number(f) for f in out.frames] == [0, 25]
        with pytest.raises(TooLarge):
            await load_video(data_url(mp4, "video/mp4"), fetcher, MediaPolicy(video_max_bytes=100))


async def test_bad_options_fail_before_fetching() -> None:
    async with MediaFetcher() as fetcher:
        with pytest.raises(TooLarge, match="num_frames"):
            await load_video("https://example.invalid/v.mp4", fetcher, POLICY, VideoOptions(num_frames=1000))


async def test_load_video_fetches_files_under_the_video_byte_cap(mp4: bytes, tmp_path: Path) -> None:
    (tmp_path / "v.mp4").write_bytes(mp4)
    url = (tmp_path / "v.mp4").as_uri()
    # The fetcher's own cap (images) is far below the video: video_max_bytes is what counts.
    async with MediaFetcher(MediaPolicy(allowed_local_dirs=(tmp_path,), max_bytes=100)) as fetcher:
        out = await load_video(url, fetcher, None, VideoOptions(num_frames=2))
        assert out.frame_indices == [0, 25]
        with pytest.raises(TooLarge, match=f"over the {len(mp4) - 1} byte limit"):
            await load_video(url, fetcher, MediaPolicy(video_max_bytes=len(mp4) - 1), VideoOptions(num_frames=2))
        with pytest.raises(TooLarge, match="over the 100 byte limit"):
            await fetcher.fetch(url)


# -- audio -------------------------------------------------------------------------------------


def test_wav_44k_stereo_becomes_16k_mono(wav: bytes) -> None:
    out = decode_audio(wav, POLICY)
    assert out.sampling_rate == 16_000
    assert out.samples.dtype == np.float32 and out.samples.ndim == 1
    assert abs(len(out.samples) - 16_000) <= 1
    assert out.duration_s == pytest.approx(1.0, abs=1e-3)
    assert peak_hz(out.samples, 16_000) == pytest.approx(440.0, abs=2)
    # Channels at amplitude 1 and 1/2 mix down to 3/4; RMS of a sine is amplitude / sqrt(2).
    middle = out.samples[1000:-1000]
    assert float(np.sqrt(np.mean(middle**2))) == pytest.approx(0.75 / np.sqrt(2), rel=0.02)


@pytest.mark.parametrize(
    ("fmt", "subtype", "rate", "declared"),
    [
        ("FLAC", "PCM_16", 48_000, "flac"),
        ("OGG", "VORBIS", 44_100, "ogg"),
        ("WAV", "FLOAT", 16_000, "wav"),
        ("MP3", "MPEG_LAYER_III", 44_100, "mp3"),
    ],
)
def test_audio_formats(fmt: str, subtype: str, rate: int, declared: str) -> None:
    if fmt not in sf.available_formats():
        pytest.skip(f"this libsndfile cannot write {fmt}")
    data = encode_audio(fmt, subtype, rate=rate, channels=1)
    assert sniff_audio(data) == declared
    out = decode_audio(data, POLICY, declared)
    assert abs(out.duration_s - 1.0) < 0.06  # MP3 may carry encoder padding
    assert peak_hz(out.samples, 16_000) == pytest.approx(440.0, abs=2)


@pytest.mark.parametrize(("fmt", "subtype"), [("WAV", "PCM_16"), ("MP3", "MPEG_LAYER_III")])
def test_pyav_decodes_what_libsndfile_cannot(monkeypatch: pytest.MonkeyPatch, fmt: str, subtype: str) -> None:
    if fmt not in sf.available_formats():
        pytest.skip(f"this libsndfile cannot write {fmt}")
    data = encode_audio(fmt, subtype)
    monkeypatch.setattr(audio_mod, "_SF_FORMATS", frozenset())
    out = decode_audio(data, POLICY)
    assert abs(out.duration_s - 1.0) < 0.06
    assert peak_hz(out.samples, 16_000) == pytest.approx(440.0, abs=2)
    middle = out.samples[2000:-2000]
    assert float(np.sqrt(np.mean(middle**2))) == pytest.approx(0.75 / np.sqrt(2), rel=0.05)


def test_mp3_that_libsndfile_refuses_falls_back_to_pyav(monkeypatch: pytest.MonkeyPatch) -> None:
    if "MP3" not in sf.available_formats():
        pytest.skip("this libsndfile cannot write MP3")
    mp3, flac = encode_audio("MP3", "MPEG_LAYER_III"), encode_audio("FLAC", "PCM_16")

    def refuse(*args: Any) -> Any:
        raise sf.SoundFileError("no MP3 support")

    monkeypatch.setattr(audio_mod, "_decode_soundfile", refuse)
    assert abs(decode_audio(mp3, POLICY).duration_s - 1.0) < 0.06
    with pytest.raises(InvalidMedia, match="corrupt or truncated FLAC audio"):
        decode_audio(flac, POLICY)


@pytest.mark.parametrize(("fmt", "subtype"), [("WAV", "PCM_16"), ("MP3", "MPEG_LAYER_III")])
def test_audio_duration_cap(fmt: str, subtype: str) -> None:
    if fmt not in sf.available_formats():
        pytest.skip(f"this libsndfile cannot write {fmt}")
    data = encode_audio(fmt, subtype, rate=16_000, seconds=1.5, channels=1)
    with pytest.raises(TooLarge, match="longer than the 1s limit"):
        decode_audio(data, MediaPolicy(audio_max_duration_s=1.0))
    assert decode_audio(data, MediaPolicy(audio_max_duration_s=1.5)).duration_s >= 1.5


def test_audio_byte_cap(wav: bytes) -> None:
    with pytest.raises(TooLarge, match="byte limit"):
        decode_audio(wav, MediaPolicy(audio_max_bytes=1000))


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(encode_audio("FLAC", "PCM_16")[:20_000], id="truncated-flac"),
        pytest.param(b"RIFF\x00\x10\x00\x00WAVE" + random.Random(1).randbytes(2000), id="garbage-wav"),
        pytest.param(encode_audio("OGG", "VORBIS")[:3000], id="truncated-vorbis"),
    ],
)
def test_corrupt_audio_is_invalid(data: bytes) -> None:
    with pytest.raises(InvalidMedia, match="corrupt or truncated"):
        decode_audio(data, POLICY)


def test_nan_samples_are_invalid() -> None:
    buf = io.BytesIO()
    sf.write(buf, np.full(1600, np.nan, np.float32), 16_000, format="WAV", subtype="FLOAT")
    with pytest.raises(InvalidMedia, match="NaN"):
        decode_audio(buf.getvalue(), POLICY)


def test_too_many_channels_are_unsupported() -> None:
    buf = io.BytesIO()
    sf.write(buf, np.zeros((160, 40), np.float32), 16_000, format="WAV", subtype="PCM_16")
    with pytest.raises(UnsupportedMedia, match="40 channels"):
        decode_audio(buf.getvalue(), POLICY)


@pytest.mark.parametrize(
    ("data", "fmt", "error", "match"),
    [
        (None, "mp3", InvalidMedia, "declared as 'mp3' but the data is WAV"),
        (None, "aiff", UnsupportedMedia, "audio format 'aiff' is not supported; accepted: WAV, FLAC"),
        (b"hello, not audio", "wav", InvalidMedia, "declared as 'wav' but the data is not recognised audio"),
        (b"hello, not audio", None, UnsupportedMedia, "not recognised audio"),
        (b"\x00\x00\x00\x20ftypM4A " + bytes(64), None, UnsupportedMedia, "MP4/M4A; accepted audio formats"),
        (b"\xff\xf1\x50\x80" + bytes(64), None, UnsupportedMedia, r"AAC \(ADTS\)"),
    ],
)
def test_declared_and_unknown_formats(
    wav: bytes, data: bytes | None, fmt: str | None, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        decode_audio(wav if data is None else data, POLICY, fmt)


ID3 = b"ID3\x04\x00\x00\x00\x00\x00\x05" + bytes(5)  # an ID3v2.4 tag with 5 bytes of body


@pytest.mark.parametrize(
    ("data", "fmt"),
    [
        (b"RIFF\x00\x00\x00\x00WAVEfmt ", "wav"),
        (b"RF64\xff\xff\xff\xffWAVEds64", "wav"),
        (b"fLaC\x00\x00\x00\x22", "flac"),
        (b"OggS\x00\x02", "ogg"),
        (b"\xff\xfb\x90\x64", "mp3"),
        (b"\xff\xf3\x64\xc4", "mp3"),  # MPEG-2 layer III
        (ID3 + b"\xff\xfb\x90\x64", "mp3"),
        (ID3 + b"fLaC", "flac"),
        (ID3 + b"\xff\xf1\x50\x80", None),  # AAC behind a tag
        (b"\xff\xf1\x50\x80", None),  # ADTS AAC shares MP3's sync word
        (b"\xff\xfb\xf0\x64", None),  # bitrate index 15 is invalid
        (b"", None),
    ],
)
def test_audio_sniffing(data: bytes, fmt: str | None) -> None:
    assert sniff_audio(data) == fmt


def test_declared_format_is_case_insensitive(wav: bytes) -> None:
    assert decode_audio(wav, POLICY, "WAV").duration_s == pytest.approx(1.0, abs=1e-3)


async def test_input_audio_base64(wav: bytes) -> None:
    out = await load_audio_base64(base64.b64encode(wav).decode(), "wav", POLICY)
    assert abs(len(out.samples) - 16_000) <= 1
    # Wrapped lines and a data: URL are tolerated.
    wrapped = base64.encodebytes(wav).decode()
    assert (await load_audio_base64(wrapped, "wav", POLICY)).samples.shape == out.samples.shape
    assert (await load_audio_base64(data_url(wav, "audio/wav"), "wav", POLICY)).samples.shape == out.samples.shape


@pytest.mark.parametrize(
    ("b64", "error", "match"),
    [
        ("not base64 at all!!", InvalidMedia, "not valid base64"),
        ("UklGR", InvalidMedia, "not valid base64"),
        ("", InvalidMedia, "empty"),
        ("A" * 2000, TooLarge, "over the 1000 byte limit"),
    ],
)
async def test_malformed_input_audio(b64: str, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        await load_audio_base64(b64, "wav", MediaPolicy(audio_max_bytes=1000))


async def test_load_audio_from_a_data_url(wav: bytes) -> None:
    async with MediaFetcher(MediaPolicy(max_bytes=100)) as fetcher:
        out = await load_audio(data_url(wav, "audio/wav"), fetcher, POLICY, "wav")
        assert peak_hz(out.samples, 16_000) == pytest.approx(440.0, abs=2)
        with pytest.raises(TooLarge):
            await load_audio(data_url(wav, "audio/wav"), fetcher, MediaPolicy(audio_max_bytes=1000))


async def test_load_audio_fetches_files_under_the_audio_byte_cap(wav: bytes, tmp_path: Path) -> None:
    (tmp_path / "a.wav").write_bytes(wav)
    url = (tmp_path / "a.wav").as_uri()
    async with MediaFetcher(MediaPolicy(allowed_local_dirs=(tmp_path,), max_bytes=100)) as fetcher:
        out = await load_audio(url, fetcher, None, "wav")
        assert peak_hz(out.samples, 16_000) == pytest.approx(440.0, abs=2)
        with pytest.raises(TooLarge, match=f"over the {len(wav) - 1} byte limit"):
            await load_audio(url, fetcher, MediaPolicy(audio_max_bytes=len(wav) - 1), "wav")


# -- policy ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"video_max_frames": 0},
        {"video_max_bytes": -1},
        {"video_max_source_pixels": 0},
        {"video_default_fps": 0.0},
        {"video_max_duration_s": float("inf")},
        {"audio_max_duration_s": float("nan")},
        {"audio_max_bytes": 0},
    ],
)
def test_policy_rejects_bad_media_caps(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        MediaPolicy(**kwargs)
