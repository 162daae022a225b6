"""Turning fetched or inline bytes into 16 kHz mono float32 samples, safely.

16 kHz mono float32 is what Whisper-style audio encoders (Whisper, Qwen2-Audio) take. The
format comes from the bytes; a declared format (OpenAI ``input_audio.format``) must agree.

Decoding is libsndfile (soundfile) first: WAV, FLAC, Ogg Vorbis/Opus and, since libsndfile
1.1, MP3. PyAV (FFmpeg) decodes an MP3 libsndfile cannot, and any format this libsndfile
build lacks. Samples are read in blocks and downmixed as they come, so memory is bounded by
the duration cap whatever the channel count, and a header that lies about the length cannot
make the decoder run past the cap.

Resampling is soxr's HQ mode directly: it is what ``librosa.resample`` runs by default
(``res_type="soxr_hq"``, identical output), without librosa's import of scipy and numba.

Caveat: libsndfile's MP3 decoder (mpg123) writes some warnings about damaged files straight
to stderr; they cannot be silenced per call from Python.
"""

from __future__ import annotations

import asyncio
import binascii
import dataclasses
import io
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Final

import numpy as np
import soundfile as sf
import soxr

from schemas.errors import InvalidMedia, MmpipeError, TooLarge, UnsupportedMedia
from stages.media.fetch import b64decode_lenient, max_base64_chars, parse_data_url
from stages.media.policy import MediaPolicy
from stages.media.video import open_container

if TYPE_CHECKING:
    from stages.media.fetch import MediaFetcher

SAMPLING_RATE: Final = 16_000

# Canonical format -> (name for messages, libsndfile major format, FFmpeg demuxer).
_FORMATS: Final[dict[str, tuple[str, str, str]]] = {
    "wav": ("WAV", "WAV", "wav"),
    "flac": ("FLAC", "FLAC", "flac"),
    "ogg": ("Ogg", "OGG", "ogg"),
    "mp3": ("MP3", "MP3", "mp3"),
}
ACCEPTED_AUDIO = "WAV, FLAC, Ogg (Vorbis, Opus), MP3"
# Names a client may declare (OpenAI input_audio.format and the transcription API's names).
_DECLARED: Final = {
    "wav": "wav",
    "wave": "wav",
    "flac": "flac",
    "ogg": "ogg",
    "oga": "ogg",
    "mp3": "mp3",
    "mpeg": "mp3",
    "mpga": "mp3",
}
# Formats recognised only to be refused with a useful message.
_FOREIGN_AUDIO: tuple[tuple[int, bytes, str], ...] = (
    (4, b"ftyp", "MP4/M4A"),
    (0, b"\x1a\x45\xdf\xa3", "WebM/Matroska"),
    (0, b"#!AMR", "AMR"),
    (0, b"caff", "CAF"),
    (0, b"wvpk", "WavPack"),
    (0, b"MAC ", "Monkey's Audio"),
    (0, b"MThd", "MIDI"),
    (0, b"\x30\x26\xb2\x75\x8e\x66\xcf\x11", "ASF/WMA"),
)

# Bounds on what a header may claim; real audio is far inside them.
_MAX_SAMPLE_RATE: Final = 384_000
_MAX_CHANNELS: Final = 32
_BLOCK_FRAMES: Final = 65_536
# Codec padding (MP3 encoder delay without a LAME tag) can put a clip cut to exactly the cap
# a few tens of milliseconds over; the feature extractor drops that tail anyway.
_DURATION_SLACK_S: Final = 0.1
_THREAD_DECODE_CHARS: Final = 1024 * 1024

_SF_FORMATS = frozenset(sf.available_formats())


@dataclasses.dataclass(frozen=True)
class DecodedAudio:
    """Mono float32 samples at ``sampling_rate`` (always 16 kHz here)."""

    samples: np.ndarray
    duration_s: float
    sampling_rate: int = SAMPLING_RATE


def _mp3_frame_sync(data: bytes, i: int) -> bool:
    if len(data) < i + 3 or data[i] != 0xFF or data[i + 1] & 0xE0 != 0xE0:
        return False
    version, layer = (data[i + 1] >> 3) & 3, (data[i + 1] >> 1) & 3
    bitrate, rate = data[i + 2] >> 4, (data[i + 2] >> 2) & 3
    # layer 0 is reserved in MP3 and is how ADTS AAC, which shares the sync word, says itself.
    return version != 1 and layer != 0 and bitrate != 15 and rate != 3


def sniff_audio(data: bytes) -> str | None:
    """The audio format ``data`` is (a key of _FORMATS), from its magic bytes, or None."""
    if data[:4] in (b"RIFF", b"RF64") and data[8:12] == b"WAVE":
        return "wav"
    if data.startswith(b"fLaC"):
        return "flac"
    if data.startswith(b"OggS"):
        return "ogg"
    if data.startswith(b"ID3") and len(data) >= 10:
        # An ID3v2 tag (size is 4 x 7 bits) usually precedes MP3 frames; look past it.
        size = 10 + ((data[6] & 0x7F) << 21 | (data[7] & 0x7F) << 14 | (data[8] & 0x7F) << 7 | (data[9] & 0x7F))
        size += 10 if data[5] & 0x10 else 0  # footer
        rest = data[size : size + 4]
        if rest.startswith(b"fLaC"):
            return "flac"
        return None if rest[:2] in (b"\xff\xf1", b"\xff\xf9") else "mp3"
    if _mp3_frame_sync(data, 0):
        return "mp3"
    return None


def _describe(data: bytes) -> str:
    if data[:2] in (b"\xff\xf1", b"\xff\xf9") or data.startswith(b"ID3"):  # sniff_audio took ID3 + MP3
        return "AAC (ADTS)"
    if data[:4] == b"FORM" and data[8:12] in (b"AIFF", b"AIFC"):
        return "AIFF"
    for offset, magic, name in _FOREIGN_AUDIO:
        if data[offset : offset + len(magic)] == magic:
            return name
    return f"not recognised audio (starts with {data[:8].hex() or 'nothing'})"


def _check_layout(sample_rate: int, channels: int) -> None:
    if not 0 < sample_rate <= _MAX_SAMPLE_RATE:
        raise InvalidMedia(f"audio has an invalid sample rate ({sample_rate} Hz)")
    if not 0 < channels <= _MAX_CHANNELS:
        raise UnsupportedMedia(f"audio has {channels} channels; at most {_MAX_CHANNELS} are supported")


def _frame_limit(sample_rate: int, policy: MediaPolicy) -> int:
    return math.floor((policy.audio_max_duration_s + _DURATION_SLACK_S) * sample_rate)


def _too_long(policy: MediaPolicy) -> TooLarge:
    return TooLarge(f"audio is longer than the {policy.audio_max_duration_s:g}s limit")


def _collect(blocks: Iterator[np.ndarray], limit: int, policy: MediaPolicy) -> np.ndarray:
    """Concatenate mono blocks, stopping as soon as they pass ``limit`` samples."""
    parts: list[np.ndarray] = []
    total = 0
    for block in blocks:
        parts.append(block)
        total += len(block)
        if total > limit:
            raise _too_long(policy)
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


def _decode_soundfile(data: bytes, fmt: str, policy: MediaPolicy) -> tuple[np.ndarray, int]:
    with sf.SoundFile(io.BytesIO(data)) as f:
        sample_rate, channels = f.samplerate, f.channels
        _check_layout(sample_rate, channels)
        limit = _frame_limit(sample_rate, policy)
        if fmt != "mp3" and f.frames > limit:  # MP3 lengths in the header are only estimates
            raise _too_long(policy)

        def blocks() -> Iterator[np.ndarray]:
            while True:
                block = f.read(frames=_BLOCK_FRAMES, dtype="float32", always_2d=True)
                if not len(block):
                    return
                yield block.mean(axis=1, dtype=np.float32)

        return _collect(blocks(), limit, policy), sample_rate


def _decode_av(data: bytes, fmt: str, policy: MediaPolicy) -> tuple[np.ndarray, int]:
    import av

    demuxer = _FORMATS[fmt][2]
    with open_container(data, demuxer) as container:
        if not container.streams.audio:
            raise InvalidMedia("media has no audio stream")
        stream = container.streams.audio[0]
        sample_rate, channels = stream.codec_context.sample_rate, stream.codec_context.channels
        _check_layout(sample_rate, channels)
        limit = _frame_limit(sample_rate, policy)
        # Planar float at the stream's own rate and layout: one row per channel, downmixed here
        # exactly as the soundfile path does.
        resampler = av.AudioResampler(format="fltp", rate=sample_rate)

        def blocks() -> Iterator[np.ndarray]:
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    yield out.to_ndarray().mean(axis=0, dtype=np.float32)
            for out in resampler.resample(None):
                yield out.to_ndarray().mean(axis=0, dtype=np.float32)

        return _collect(blocks(), limit, policy), sample_rate


def _decode_native(data: bytes, fmt: str, policy: MediaPolicy) -> tuple[np.ndarray, int]:
    """Mono float32 samples at the file's own rate."""
    # PyAV (FFmpeg) only where audio is decoded (see stages.media.video).
    import av

    name, sf_format, _ = _FORMATS[fmt]
    try:
        if sf_format not in _SF_FORMATS:
            return _decode_av(data, fmt, policy)
        try:
            return _decode_soundfile(data, fmt, policy)
        except sf.SoundFileError:
            if fmt != "mp3":
                raise
            # Older libsndfile has no MP3, and mpg123 refuses some files FFmpeg plays.
            return _decode_av(data, fmt, policy)
    except av.FFmpegError as e:
        # Before MemoryError: FFmpeg's ENOMEM (av.error.MemoryError) means a corrupt header.
        raise InvalidMedia(f"corrupt or truncated {name} audio: {e.strerror}") from None
    except (MmpipeError, MemoryError):
        raise
    except sf.LibsndfileError as e:
        raise InvalidMedia(f"corrupt or truncated {name} audio: {e.error_string}") from None
    except Exception as e:  # both libraries report some damage as other exception types
        raise InvalidMedia(f"corrupt or truncated {name} audio: {type(e).__name__}: {e}") from None


def decode_audio(data: bytes, policy: MediaPolicy, fmt: str | None = None) -> DecodedAudio:
    """Decode ``data`` to 16 kHz mono float32 under ``policy``.

    ``fmt`` is a declared format (OpenAI ``input_audio.format``: "wav", "mp3", ...); when given
    the bytes must be that format. UnsupportedMedia for a format not accepted here, InvalidMedia
    for corrupt audio or a wrong declared format, TooLarge over the byte or duration cap.
    """
    if len(data) > policy.audio_max_bytes:
        raise TooLarge(f"audio is {len(data)} bytes, over the {policy.audio_max_bytes} byte limit")
    declared: str | None = None
    if fmt is not None:
        declared = _DECLARED.get(fmt.strip().lower())
        if declared is None:
            raise UnsupportedMedia(f"audio format {fmt!r} is not supported; accepted: {ACCEPTED_AUDIO}")
    sniffed = sniff_audio(data)
    if sniffed is None:
        what = _describe(data)
        if declared is not None:
            raise InvalidMedia(f"audio declared as {fmt!r} but the data is {what}")
        raise UnsupportedMedia(f"media is {what}; accepted audio formats: {ACCEPTED_AUDIO}")
    if declared is not None and declared != sniffed:
        raise InvalidMedia(f"audio declared as {fmt!r} but the data is {_FORMATS[sniffed][0]}")
    mono, sample_rate = _decode_native(data, sniffed, policy)
    if not len(mono):
        raise InvalidMedia(f"{_FORMATS[sniffed][0]} audio has no samples")
    if not np.isfinite(mono).all():  # float WAV can carry NaN and inf
        raise InvalidMedia("audio has NaN or infinite samples")
    if sample_rate != SAMPLING_RATE:
        mono = soxr.resample(mono, sample_rate, SAMPLING_RATE, quality="HQ")
    samples = np.ascontiguousarray(mono, dtype=np.float32)
    return DecodedAudio(samples, len(samples) / SAMPLING_RATE)


def _decode_base64(b64: str, max_bytes: int) -> bytes:
    """The bytes of an ``input_audio.data`` payload: plain base64, or a data: URL for leniency."""
    if b64[:5].lower() == "data:":
        return parse_data_url(b64, max_bytes).data
    text = "".join(b64.split())
    if len(text) > max_base64_chars(max_bytes):
        raise TooLarge(f"input_audio data is over the {max_bytes} byte limit")
    if not text:
        raise InvalidMedia("input_audio data is empty")
    try:
        data = b64decode_lenient(text)
    except (binascii.Error, ValueError) as e:
        raise InvalidMedia(f"input_audio data is not valid base64 ({e})") from None
    if len(data) > max_bytes:
        raise TooLarge(f"input_audio data is {len(data)} bytes, over the {max_bytes} byte limit")
    return data


async def load_audio(
    url: str, fetcher: MediaFetcher, policy: MediaPolicy | None = None, fmt: str | None = None
) -> DecodedAudio:
    """Fetch ``url`` with ``fetcher`` and decode it (in a thread) under ``policy`` (default: the fetcher's).

    The fetch runs under the fetcher's policy with ``policy``'s ``audio_max_bytes`` as its byte cap.
    """
    policy = policy if policy is not None else fetcher.policy
    data = await fetcher.fetch(url, max_bytes=policy.audio_max_bytes)
    return await asyncio.to_thread(decode_audio, data, policy, fmt)


async def load_audio_base64(b64: str, fmt: str, policy: MediaPolicy) -> DecodedAudio:
    """Decode an OpenAI ``input_audio`` part (base64 ``data`` plus ``format``) in a thread."""
    if len(b64) > _THREAD_DECODE_CHARS:
        data = await asyncio.to_thread(_decode_base64, b64, policy.audio_max_bytes)
    else:
        data = _decode_base64(b64, policy.audio_max_bytes)
    return await asyncio.to_thread(decode_audio, data, policy, fmt)
