"""Turning fetched bytes into a few sampled RGB frames of a video, safely and cheaply.

A video is sampled, never decoded whole when that can be avoided: one demux pass (packets
only, no pixels) lists every frame's timestamp and where the keyframes are, the frames to
keep are chosen from that list, and the decoder then seeks to the keyframe before each one.
The list also makes sampling exact: ``num_frames`` picks frame *indices* the way the
transformers video processors do, and ``fps`` picks by time, so variable-frame-rate video
(phones) is sampled by what is on screen, not by an assumed constant rate.

Safety: the container is sniffed from the bytes and PyAV is told which demuxer to use (no
probing, so no playlist or concat demuxer that could open other files); the codec must be
one of a short list; the frame size is checked from the stream header before any pixel is
decoded, and FFmpeg's own ``max_pixels`` guard backs that up if the size changes mid-stream.
Every PyAV error becomes InvalidMedia: clients see 400s, never a raw ``av`` exception.

PyAV leaves FFmpeg's log callback off by default, so corrupt input does not spam stderr.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import io
import math
from array import array
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

from schemas.errors import InvalidMedia, InvalidRequest, MmpipeError, TooLarge, UnsupportedMedia
from schemas.processed import MediaItem, MediaKind
from stages.media.image import sniff_format
from stages.media.policy import MediaPolicy

if TYPE_CHECKING:
    from av.container import InputContainer
    from av.video.frame import VideoFrame
    from av.video.stream import VideoStream

    from stages.media.fetch import MediaFetcher

# Sniffed container -> (FFmpeg demuxer, name for messages).
_CONTAINERS: dict[str, tuple[str, str]] = {
    "mp4": ("mov", "MP4/MOV"),
    "matroska": ("matroska", "WebM/Matroska"),
    "avi": ("avi", "AVI"),
}
ACCEPTED_CONTAINERS = "MP4/MOV, WebM/Matroska, AVI"

# Top-level QuickTime atoms that old .mov files start with instead of ftyp.
_QUICKTIME_ATOMS = frozenset({b"moov", b"mdat", b"wide", b"free", b"skip", b"pnot"})
# ftyp brands that are still images (handled by decode_image), not video.
_IMAGE_BRANDS = frozenset({b"avif", b"avis", b"heic", b"heix", b"hevc", b"hevx", b"heim", b"heis", b"mif1", b"msf1"})
# Video containers recognised only to be refused with a useful message.
_FOREIGN_VIDEO: tuple[tuple[bytes, str], ...] = (
    (b"FLV\x01", "FLV"),
    (b"\x00\x00\x01\xba", "MPEG-PS"),
    (b"\x30\x26\xb2\x75\x8e\x66\xcf\x11", "ASF/WMV"),
    (b"OggS", "Ogg"),
)

# Decoders (by codec id name) a video may use: what cameras, browsers and editors write.
# FFmpeg decodes hundreds of formats; the rarely used ones are where its bugs are found.
ALLOWED_VIDEO_CODECS = frozenset(
    {"h264", "hevc", "vp8", "vp9", "av1", "mpeg4", "mpeg1video", "mpeg2video", "mjpeg", "h263", "theora"}
)

# Frames per second of video time the index may hold: far above any real camera (240 fps
# slow motion), low enough that a file of tiny packets cannot make the index huge. Also the
# highest sampling fps a request may ask for.
_MAX_INDEX_FPS = 1000
# A frame at a sampling time up to this much (seconds) early still counts as at that time.
_TIME_EPS = 1e-6

_ROTATIONS = {
    90: Image.Transpose.ROTATE_90,
    180: Image.Transpose.ROTATE_180,
    -180: Image.Transpose.ROTATE_180,
    -90: Image.Transpose.ROTATE_270,
    270: Image.Transpose.ROTATE_270,
}


@dataclasses.dataclass(frozen=True)
class VideoOptions:
    """How one request wants its video sampled; the caps come from the MediaPolicy.

    Give ``num_frames`` (evenly spread over the whole video) or ``fps`` (one frame every
    1/fps s), not both; with neither the policy's ``video_default_fps`` is used. ``max_frames``
    caps fps sampling (the frames are then spread evenly over the video) and defaults to the
    policy's ``video_max_frames``. ``pad_to_multiple`` is set by the server for the model: Qwen-VL
    groups frames in pairs (temporal_patch_size=2), so the last frame is repeated up to a multiple.
    Padding comes after the cap, so it may exceed ``max_frames`` by up to ``pad_to_multiple - 1``.
    """

    num_frames: int | None = None
    fps: float | None = None
    max_frames: int | None = None
    pad_to_multiple: int = 1

    def __post_init__(self) -> None:
        if self.num_frames is not None and self.fps is not None:
            raise InvalidRequest("video sampling: give num_frames or fps, not both")
        if self.num_frames is not None and self.num_frames <= 0:
            raise InvalidRequest(f"video sampling: num_frames must be positive, got {self.num_frames}")
        if self.fps is not None and not 0 < self.fps <= _MAX_INDEX_FPS:  # also refuses NaN
            raise InvalidRequest(f"video sampling: fps must be positive and at most {_MAX_INDEX_FPS}, got {self.fps}")
        if self.max_frames is not None and self.max_frames <= 0:
            raise InvalidRequest(f"video sampling: max_frames must be positive, got {self.max_frames}")
        if self.pad_to_multiple < 1:
            # Set by the server from the model config, never by a client.
            raise ValueError(f"VideoOptions.pad_to_multiple must be >= 1, got {self.pad_to_multiple}")


def video_options(item: MediaItem, pad_to_multiple: int) -> VideoOptions | None:
    """How a video item is sampled, as its request asks (None: not a video).
    Raises InvalidRequest for sampling that cannot be (before any download)."""
    if item.kind is not MediaKind.VIDEO:
        return None
    return VideoOptions(
        num_frames=item.num_frames, fps=item.fps, max_frames=item.max_frames, pad_to_multiple=pad_to_multiple
    )


@dataclasses.dataclass(frozen=True)
class DecodedVideo:
    """Sampled frames and what a video processor needs to know about them.

    ``timestamps`` are seconds from the first frame. ``fps`` is the sampling rate the frames
    represent: the requested fps when every requested time got its own frame, otherwise
    frames / duration. ``frame_indices`` index the source's frames in presentation order.
    Padding repeats the last frame, timestamp and index.
    """

    frames: list[Image.Image]
    timestamps: list[float]
    fps: float
    duration_s: float
    frame_indices: list[int]
    total_frames: int
    source_fps: float


@dataclasses.dataclass(frozen=True, slots=True)
class _Index:
    """Every frame of the video stream, from one demux pass without decoding."""

    pts: np.ndarray  # int64, sorted: presentation timestamps in time_base units
    times: np.ndarray  # float64: seconds from the first frame
    # (pts, seek timestamp) of each keyframe, sorted by pts. The seek timestamp is min(pts, dts):
    # mov seeks by dts, matroska by pts; the smaller never lands past the keyframe.
    keyframes: list[tuple[int, int]]
    duration_s: float


class _SeekMissed(Exception):
    """A seek did not land at or before the wanted frame; decode from the start instead."""


def sniff_container(data: bytes) -> str | None:
    """The video container ``data`` is (a key of _CONTAINERS), from its magic bytes, or None."""
    if data[4:8] == b"ftyp":
        return None if data[8:12] in _IMAGE_BRANDS else "mp4"
    if data[4:8] in _QUICKTIME_ATOMS:
        return "mp4"
    if data.startswith(b"\x1a\x45\xdf\xa3"):
        return "matroska"
    if data[:4] == b"RIFF" and data[8:12] == b"AVI ":
        return "avi"
    return None


def _ebml_vint(data: bytes, i: int) -> tuple[int | None, int]:
    """An EBML variable-length size at ``i``: (value or None when 'unknown', next offset)."""
    if i >= len(data) or data[i] == 0:
        raise InvalidMedia("corrupt Matroska header")
    length = 9 - data[i].bit_length()
    if i + length > len(data):
        raise InvalidMedia("corrupt or truncated Matroska header")
    value = int.from_bytes(data[i : i + length], "big") & ((1 << (7 * length)) - 1)
    return (None if value == (1 << (7 * length)) - 1 else value), i + length


def _declared_size(kind: str, data: bytes) -> int | None:
    """How long the container's own size fields say the file is; None when they do not say.

    FFmpeg plays a cut-off file up to where it stops, so a truncated upload would otherwise be
    sampled as a shorter video. (A live-written WebM has an unknown size and is not checked.)
    """
    if kind == "avi":
        riff = int.from_bytes(data[4:8], "little")
        return riff + 8 if riff else None
    if kind == "matroska":
        header_size, i = _ebml_vint(data, 4)
        if header_size is None:
            raise InvalidMedia("corrupt Matroska header")
        i += header_size
        if data[i : i + 4] != b"\x18\x53\x80\x67":  # the Segment
            return None
        size, start = _ebml_vint(data, i + 4)
        return None if size is None else start + size
    # mp4/mov: the top-level boxes (atoms) must all be there.
    i = 0
    while i + 8 <= len(data):
        size = int.from_bytes(data[i : i + 4], "big")
        if size == 1:  # a 64-bit size follows the type
            if i + 16 > len(data):
                return i + 16
            size = int.from_bytes(data[i + 8 : i + 16], "big")
        if size == 0:  # the last box, running to the end of the file
            return None
        if size < 8:
            raise InvalidMedia(f"corrupt MP4/MOV: box of size {size} at offset {i}")
        i += size
    return i if i > len(data) else None


def _describe_foreign(data: bytes) -> str:
    image = sniff_format(data)
    if image is not None:
        return f"a {image} image"
    if len(data) > 376 and data[0] == data[188] == data[376] == 0x47:
        return "MPEG-TS"
    for magic, name in _FOREIGN_VIDEO:
        if data.startswith(magic):
            return name
    return f"not a recognised video (starts with {data[:8].hex() or 'nothing'})"


def _frame_limit(options: VideoOptions, policy: MediaPolicy) -> int:
    cap = policy.video_max_frames
    if options.max_frames is not None and options.max_frames > cap:
        raise TooLarge(f"video max_frames={options.max_frames} is over the limit of {cap} frames per video")
    limit = options.max_frames if options.max_frames is not None else cap
    if options.num_frames is not None and options.num_frames > limit:
        raise TooLarge(f"video num_frames={options.num_frames} is over the limit of {limit} frames per video")
    return limit


def _check_duration(seconds: float, policy: MediaPolicy) -> None:
    if seconds > policy.video_max_duration_s:
        raise TooLarge(f"video is {seconds:.1f}s long, over the {policy.video_max_duration_s:g}s limit")


def _check_source_size(width: int, height: int, policy: MediaPolicy) -> None:
    if width * height > policy.video_max_source_pixels:
        raise TooLarge(
            f"video frames are {width}x{height} = {width * height} pixels, "
            f"over the {policy.video_max_source_pixels} pixel limit"
        )


def _fit(width: int, height: int, max_pixels: int) -> tuple[int, int]:
    """The largest size with ``width``'s aspect ratio and at most ``max_pixels`` pixels."""
    if width * height <= max_pixels:
        return width, height
    scale = math.sqrt(max_pixels / (width * height))
    w, h = max(1, math.floor(width * scale)), max(1, math.floor(height * scale))
    while w * h > max_pixels:  # floating point can leave it one row over
        w, h = (w - 1, h) if w >= h else (w, h - 1)
    return w, h


def open_container(data: bytes, demuxer: str) -> InputContainer:
    """``data`` opened with the demuxer ``demuxer`` forced: FFmpeg never
    probes, so never picks hls, concat or image2. PyAV before 19 decodes
    metadata strictly unless told to ignore bad bytes; 19 dropped the
    option (the last wheels for Python 3.11 are 18.x, for 3.12+ 19.x)."""
    import av

    if int(av.__version__.split(".")[0]) < 19:
        return av.open(io.BytesIO(data), mode="r", format=demuxer, metadata_errors="ignore")
    return av.open(io.BytesIO(data), mode="r", format=demuxer)


def _video_stream(container: InputContainer, policy: MediaPolicy) -> VideoStream:
    if not container.streams.video:
        raise InvalidMedia("media has no video stream")
    stream = container.streams.video[0]
    codec = stream.codec_context.codec.canonical_name
    if codec not in ALLOWED_VIDEO_CODECS:
        raise UnsupportedMedia(
            f"{codec} video is not supported; accepted codecs: {', '.join(sorted(ALLOWED_VIDEO_CODECS))}"
        )
    ctx = stream.codec_context
    _check_source_size(ctx.width, ctx.height, policy)
    # FFmpeg's own guard for frames that grow mid-stream, with headroom: it counts the width
    # padded to the stride alignment, and _check_source_size is the exact check.
    ctx.options = {"max_pixels": str(2 * policy.video_max_source_pixels)}
    return stream


def _header_duration(container: InputContainer, stream: VideoStream) -> float | None:
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration:
        import av

        return container.duration / av.time_base
    return None


def _index(container: InputContainer, stream: VideoStream, policy: MediaPolicy) -> _Index:
    """List the stream's frames from its packets: a demux pass, no decoding."""
    time_base = stream.time_base
    if time_base is None or time_base <= 0:
        raise InvalidMedia("video stream has no time base")
    max_ticks = int(policy.video_max_duration_s / time_base) + 1
    max_packets = math.ceil(policy.video_max_duration_s * _MAX_INDEX_FPS)
    pts = array("q")
    keyframes: list[tuple[int, int]] = []
    durations: dict[int, int] = {}
    first: int | None = None
    packets = 0
    for packet in container.demux(stream):
        if packet.size == 0:  # the end-of-stream marker
            continue
        packets += 1
        if packet.is_corrupt:
            raise InvalidMedia("video is corrupt or truncated (a damaged packet)")
        if packet.is_discard:  # before the start of an edit list: decoded, never shown
            continue
        ts = packet.pts if packet.pts is not None else packet.dts
        if ts is None:
            raise InvalidMedia("video has frames without timestamps")
        pts.append(ts)
        if packet.is_keyframe:
            keyframes.append((ts, min(ts, packet.dts) if packet.dts is not None else ts))
        if packet.duration and packet.duration > 0:
            durations[ts] = packet.duration
        first = ts if first is None else min(first, ts)
        if ts - first > max_ticks:
            _check_duration(float((ts - first) * time_base), policy)
        if len(pts) > max_packets:
            raise TooLarge(f"video has more than {max_packets} frames")
    if stream.frames and packets < stream.frames:
        # mov lists every frame in its index; fewer packets means the data was cut off.
        raise InvalidMedia(f"video is truncated: {packets} of {stream.frames} frames present")
    if not pts:
        raise InvalidMedia("video has no frames")
    sorted_pts = np.unique(np.frombuffer(pts, dtype=np.int64))
    first, last = int(sorted_pts[0]), int(sorted_pts[-1])
    # Checked before any numpy arithmetic on the timestamps, which could overflow int64.
    _check_duration(float((last - first) * time_base), policy)
    last_duration = durations.get(last) or (int(np.median(np.diff(sorted_pts))) if len(sorted_pts) > 1 else 0)
    duration_s = float((last - first + last_duration) * time_base)
    _check_duration(duration_s, policy)
    times = (sorted_pts - sorted_pts[0]).astype(np.float64) * float(time_base)
    return _Index(sorted_pts, times, sorted(set(keyframes)), duration_s)


def _sample(index: _Index, options: VideoOptions, policy: MediaPolicy, limit: int) -> tuple[list[int], float | None]:
    """The frame indices to keep, and the fps they stand for when exactly the requested fps."""
    total = len(index.pts)
    if options.num_frames is not None:
        # As transformers' video processors: evenly spaced over all frames, ends included.
        n = min(options.num_frames, total)
        picked = np.linspace(0, total - 1, n).round().astype(int)
        return sorted({int(i) for i in picked}), None
    fps = options.fps if options.fps is not None else policy.video_default_fps
    # One sampling time every 1/fps s from the first frame, while still inside the video.
    count = max(1, math.ceil(index.duration_s * fps - _TIME_EPS))
    steps = range(count) if count <= limit else (int(k) for k in np.linspace(0, count - 1, limit).round())
    chosen: list[int] = []
    for k in steps:
        # The frame on screen at that time: the last one shown at or before it.
        i = max(0, int(np.searchsorted(index.times, k / fps + _TIME_EPS, side="right")) - 1)
        if not chosen or chosen[-1] != i:
            chosen.append(i)
    exact = count <= limit and len(chosen) == count
    return chosen, (float(fps) if exact else None)


def _to_image(frame: VideoFrame, policy: MediaPolicy) -> Image.Image:
    _check_source_size(frame.width, frame.height, policy)
    width, height = _fit(frame.width, frame.height, policy.video_max_pixels)
    if (width, height) == (frame.width, frame.height):
        img = frame.to_image()
    else:
        img = frame.to_image(width=width, height=height, interpolation="AREA")
    # Phones store portrait video landscape plus a display rotation; show it as played.
    method = _ROTATIONS.get(round(frame.rotation))
    return img.transpose(method) if method is not None else img


def _seek_needed(keyframes: list[tuple[int, int]], position: int, target: int) -> int | None:
    """The seek timestamp of the last keyframe at or before ``target``, if one lies after ``position``."""
    i = bisect.bisect_right(keyframes, (target, math.inf)) - 1
    if i < 0 or keyframes[i][0] <= position:
        return None
    return keyframes[i][1]


def _read_frames(
    data: bytes, demuxer: str, index: _Index, wanted: list[int], policy: MediaPolicy, *, seek: bool
) -> list[Image.Image]:
    """Decode the frames at ``wanted`` (sorted indices), seeking past long stretches if ``seek``."""
    out: list[Image.Image] = []
    with open_container(data, demuxer) as container:
        stream = _video_stream(container, policy)
        frames = iter(container.decode(stream))
        decoded = 0  # frames seen since the start; used only when frames lack timestamps
        position = int(index.pts[0])
        for i in wanted:
            target = int(index.pts[i])
            seek_ts = _seek_needed(index.keyframes, position, target) if seek else None
            if seek_ts is not None:
                container.seek(seek_ts, stream=stream, backward=True)
                frames = iter(container.decode(stream))
            for frame in frames:
                if frame.pts is None:
                    if seek:
                        raise _SeekMissed
                    ts = int(index.pts[min(decoded, len(index.pts) - 1)])
                else:
                    ts = frame.pts
                decoded += 1
                if seek_ts is not None and ts > target:
                    raise _SeekMissed  # landed past the frame: no index, or a lying one
                seek_ts = None
                position = ts
                if ts >= target:
                    out.append(_to_image(frame, policy))
                    break
            else:
                raise InvalidMedia(f"video ends before its frame at {index.times[i]:.3f}s could be decoded")
    return out


def _decode(data: bytes, demuxer: str, policy: MediaPolicy, options: VideoOptions, limit: int) -> DecodedVideo:
    with open_container(data, demuxer) as container:
        stream = _video_stream(container, policy)
        header = _header_duration(container, stream)
        if header is not None:
            _check_duration(header, policy)  # refuse before reading every packet
        index = _index(container, stream, policy)
        average_rate = stream.average_rate
    wanted, exact_fps = _sample(index, options, policy, limit)
    try:
        frames = _read_frames(data, demuxer, index, wanted, policy, seek=True)
    except _SeekMissed:
        frames = _read_frames(data, demuxer, index, wanted, policy, seek=False)
    if not frames:
        raise InvalidMedia("video has no decodable frames")
    timestamps = [float(index.times[i]) for i in wanted]
    duration = index.duration_s
    total = len(index.pts)
    source_fps = total / duration if duration > 0 else float(average_rate or 1)
    fps = exact_fps if exact_fps is not None else (len(frames) / duration if duration > 0 else source_fps)
    while len(frames) % options.pad_to_multiple:
        frames.append(frames[-1])
        timestamps.append(timestamps[-1])
        wanted.append(wanted[-1])
    return DecodedVideo(frames, timestamps, fps, duration, wanted, total, source_fps)


def decode_video(data: bytes, policy: MediaPolicy, options: VideoOptions | None = None) -> DecodedVideo:
    """Sample RGB frames from ``data`` (MP4/MOV, WebM/Matroska or AVI) under ``policy``.

    UnsupportedMedia for anything but those containers or for an unusual codec, InvalidMedia
    for corrupt or truncated video, TooLarge over the policy's byte, duration, frame or pixel caps.
    Frames over ``video_max_pixels`` are scaled down, aspect kept.
    """
    # PyAV (FFmpeg) is imported where video is decoded, not by every process
    # that imports stages.media: the bridge, the processor, image-only workers.
    import av

    options = options if options is not None else VideoOptions()
    limit = _frame_limit(options, policy)
    if len(data) > policy.video_max_bytes:
        raise TooLarge(f"video is {len(data)} bytes, over the {policy.video_max_bytes} byte limit")
    kind = sniff_container(data)
    if kind is None:
        raise UnsupportedMedia(f"media is {_describe_foreign(data)}; accepted video formats: {ACCEPTED_CONTAINERS}")
    demuxer, name = _CONTAINERS[kind]
    declared = _declared_size(kind, data)
    if declared is not None and declared > len(data):
        raise InvalidMedia(
            f"{name} video is corrupt or truncated: its headers claim {declared} bytes, the file has {len(data)}"
        )
    try:
        return _decode(data, demuxer, policy, options, limit)
    except av.FFmpegError as e:
        # First: FFmpeg's ENOMEM (av.error.MemoryError, also a MemoryError) is how it refuses
        # an absurd size in a corrupt header, not the process running out of memory.
        raise InvalidMedia(f"corrupt or truncated {name} video: {e.strerror}") from None
    except (MmpipeError, MemoryError):
        raise
    except Exception as e:  # PyAV reports some damage as ValueError, UnicodeError, ...
        raise InvalidMedia(f"corrupt or truncated {name} video: {type(e).__name__}: {e}") from None


async def load_video(
    url: str, fetcher: MediaFetcher, policy: MediaPolicy | None = None, options: VideoOptions | None = None
) -> DecodedVideo:
    """Fetch ``url`` with ``fetcher`` and sample it (in a thread) under ``policy`` (default: the fetcher's).

    The fetch runs under the fetcher's policy (schemes, addresses, timeout) with ``policy``'s
    ``video_max_bytes`` as its byte cap, for data:, http(s): and file: URLs alike.
    """
    policy = policy if policy is not None else fetcher.policy
    options = options if options is not None else VideoOptions()
    _frame_limit(options, policy)  # a bad request fails before the download
    data = await fetcher.fetch(url, max_bytes=policy.video_max_bytes)
    return await asyncio.to_thread(decode_video, data, policy, options)
