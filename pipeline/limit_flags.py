"""Command-line flags for the limits a worker enforces: the media limits
(``stages.media.MediaPolicy``) and the processor's (``ProcessorLimits``). One
flag per limit, its default the limit's, forwarded by ``mmpipe up`` to every
worker it starts."""

from __future__ import annotations

import argparse
from typing import Any

from stages.media import MediaPolicy
from stages.processor import ProcessorLimits

_DEFAULTS = MediaPolicy()

# (MediaPolicy field, flag, type, help)
_LIMITS: tuple[tuple[str, str, type, str], ...] = (
    ("max_bytes", "--image-max-bytes", int, "bytes of one image (or embeddings payload), inline or fetched"),
    ("max_pixels", "--image-max-pixels", int, "width x height of one image, checked before decoding"),
    ("fetch_timeout_s", "--media-fetch-timeout", float, "seconds for one media download"),
    ("video_max_bytes", "--video-max-bytes", int, "bytes of one video, inline, fetched or a local file"),
    ("video_max_duration_s", "--video-max-seconds", float, "seconds of one video"),
    ("video_max_frames", "--video-max-frames", int, "frames sampled from one video at most (max_frames cap)"),
    ("video_default_fps", "--video-default-fps", float, "sampling rate when a request gives no num_frames or fps"),
    ("video_max_pixels", "--video-frame-max-pixels", int, "sampled frames larger than this are scaled down"),
    ("audio_max_bytes", "--audio-max-bytes", int, "bytes of one audio clip"),
    ("audio_max_duration_s", "--audio-max-seconds", float, "seconds of one audio clip"),
    ("decoded_cache_bytes", "--decoded-cache-bytes", int, "decoded media an encoding worker keeps by content (0: off)"),
    (
        "encode_batch_items",
        "--encode-batch",
        int,
        "media items one encoder call takes from requests waiting together (1: each alone, exact embeddings; "
        "more: GPU throughput, last-bit differences)",
    ),
)


def add_media_flags(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("media limits (encoding workers)")
    group.add_argument(
        "--media-dir",
        action="append",
        default=[],
        help="serve file:// media from under this directory (repeatable; none: file:// is refused)",
    )
    for field, flag, kind, text in _LIMITS:
        default = getattr(_DEFAULTS, field)
        group.add_argument(
            flag,
            dest=f"media_{field}",
            type=kind,
            default=default,
            metavar="N" if kind is int else "S",
            help=f"{text} (default {default})",
        )


def media_policy(args: argparse.Namespace) -> MediaPolicy:
    """The policy the flags describe; a bad value exits with the policy's message."""
    limits: dict[str, Any] = {field: getattr(args, f"media_{field}") for field, *_ in _LIMITS}
    try:
        return MediaPolicy(allowed_local_dirs=tuple(args.media_dir), **limits)
    except ValueError as exc:
        raise SystemExit(f"mmpipe: {exc}") from None


def media_flag_args(policy: MediaPolicy) -> list[str]:
    """The flags that give ``policy`` to a child process (what differs from the defaults)."""
    out: list[str] = []
    for directory in policy.allowed_local_dirs:
        out += ["--media-dir", str(directory)]
    for field, flag, _, _ in _LIMITS:
        value = getattr(policy, field)
        if value != getattr(_DEFAULTS, field):
            out += [flag, str(value)]
    return out


_PROCESSOR_DEFAULTS = ProcessorLimits()
# (ProcessorLimits field, flag, least value, help)
_PROCESSOR_LIMITS: tuple[tuple[str, str, int, str], ...] = (
    ("max_images", "--max-images", 0, "images in one request (0: none)"),
    ("max_videos", "--max-videos", 0, "videos in one request (0: none)"),
    ("max_audios", "--max-audios", 0, "audio clips in one request (0: none)"),
    ("max_prompt_tokens", "--max-prompt-tokens", 1, "prompt tokens before media are expanded (413 over it)"),
    ("default_max_tokens", "--default-max-tokens", 1, "max_tokens of a request that gives none"),
    ("max_stop_strings", "--max-stop-strings", 0, "stop strings in one request"),
)


def add_processor_flags(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("request limits (the processor)")
    for field, flag, _, text in _PROCESSOR_LIMITS:
        default = getattr(_PROCESSOR_DEFAULTS, field)
        group.add_argument(
            flag, dest=f"limit_{field}", type=int, default=default, metavar="N", help=f"{text} (default {default})"
        )


def processor_limits(args: argparse.Namespace) -> ProcessorLimits:
    for field, flag, least, _ in _PROCESSOR_LIMITS:
        if getattr(args, f"limit_{field}") < least:
            raise SystemExit(f"mmpipe: {flag} must be at least {least}")
    return ProcessorLimits(**{field: getattr(args, f"limit_{field}") for field, *_ in _PROCESSOR_LIMITS})


def processor_limit_args(limits: ProcessorLimits) -> list[str]:
    """The flags that give ``limits`` to a child process (what differs from the defaults)."""
    out: list[str] = []
    for field, flag, _, _ in _PROCESSOR_LIMITS:
        value = getattr(limits, field)
        if value != getattr(_PROCESSOR_DEFAULTS, field):
            out += [flag, str(value)]
    return out
