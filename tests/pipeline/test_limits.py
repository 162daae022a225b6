"""The limit settings reach what enforces them: the processor its limits, a
worker's encode step its media policy (file:// media only from the
directories given), every work queue its size; a bad limit stops the
process at start."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.cli import main, parser
from pipeline.serve import WorkerSettings
from pipeline.settings import SettingError, WorkerProcess, load_kind
from schemas.errors import TooLarge, UrlNotAllowed
from schemas.processed import MediaItem, MediaKind, ProcessedRequest
from schemas.request import ChatMessage, GenerateRequest, ImagePart, ImageURL, TextPart
from stages.contract import HopContext
from stages.encoder import MediaEncoder
from stages.media import MediaFetcher, MediaPolicy
from stages.models import builtin_path, resolve_model
from stages.models.traits import load_traits
from stages.processor import Processor, ProcessorLimits
from stages.torch_engine.engine import TorchEngine
from stages.torch_engine.scheduler import EngineThread
from tests.stages.test_media_av import encode_video


def _worker(*flags: str) -> WorkerProcess:
    settings: WorkerProcess = load_kind("worker", parser().parse_args(["worker", "encode", *flags]), {}).settings
    return settings


def _settings(*flags: str) -> WorkerSettings:
    return _worker(*flags).worker


def test_defaults_are_the_policy_defaults() -> None:
    assert _settings().media == MediaPolicy()
    assert _settings().limits == ProcessorLimits()


def test_flags_set_the_limits(tmp_path: Path) -> None:
    flags = ["--media-dir", str(tmp_path), "--video-max-frames", "8", "--audio-max-seconds", "12.5"]
    flags += ["--image-max-pixels", "1000000", "--video-default-fps", "1"]
    policy = _settings(*flags).media
    assert policy.allowed_local_dirs == (str(tmp_path),)
    assert (policy.video_max_frames, policy.audio_max_duration_s) == (8, 12.5)
    assert (policy.max_pixels, policy.video_default_fps) == (1_000_000, 1.0)


def test_a_bad_limit_stops_the_worker_at_start() -> None:
    with pytest.raises(SettingError, match="video_max_frames must be positive"):
        _settings("--video-max-frames", "0")
    with pytest.raises(SettingError, match="default-max-tokens must be at least 1"):
        _settings("--default-max-tokens", "0")
    with pytest.raises(SystemExit, match="default-max-tokens must be at least 1"):
        main(["worker", "processor", "--default-max-tokens", "0"])


def test_processor_limit_flags_reach_the_processor(tiny_model_dir: Path) -> None:
    limits = _settings("--max-images", "1", "--max-prompt-tokens", "50", "--default-max-tokens", "7").limits
    processor = Processor(load_traits(resolve_model(str(tiny_model_dir))), limits=limits)
    image = ImagePart(ImageURL("data:image/png;base64,AAAA"))

    def ask(*parts: ImagePart | TextPart) -> ProcessedRequest:
        message = ChatMessage("user", list(parts))
        return processor.process(GenerateRequest(request_id="r", model=processor.models[0], messages=[message]))

    assert ask(image, TextPart("hi")).max_tokens == 7
    with pytest.raises(TooLarge, match="2 image items in one request; the limit is 1"):
        ask(image, image)
    with pytest.raises(TooLarge, match="the limit is 50"):
        ask(TextPart("word " * 60))


def _video_request(url: str) -> ProcessedRequest:
    request = GenerateRequest(request_id="r", model="m", messages=[ChatMessage("user", "x")])
    item = MediaItem(MediaKind.VIDEO, url, 0, num_frames=4)
    return ProcessedRequest(request=request, prompt_token_ids=[0], media=[item], route=["encode"], max_tokens=1, seed=0)


async def test_file_urls_are_served_only_from_a_media_dir(tmp_path: Path, mmpipe_home: Path) -> None:
    allowed, other = tmp_path / "media", tmp_path / "elsewhere"
    for d in (allowed, other):
        d.mkdir()
        (d / "clip.mp4").write_bytes(encode_video(n=8))
    policy = _settings("--media-dir", str(allowed)).media
    thread, fetcher = EngineThread(), MediaFetcher(policy)
    encoder = MediaEncoder(TorchEngine(builtin_path("tiny-qwen2-vl")), thread, fetcher, policy)
    try:
        [item] = await encoder.encode(_video_request((allowed / "clip.mp4").as_uri()), HopContext())
        assert item.kind is MediaKind.VIDEO and item.grid_thw[0] == 2  # 4 frames, 2 a temporal patch
        with pytest.raises(UrlNotAllowed):
            await encoder.encode(_video_request((other / "clip.mp4").as_uri()), HopContext())
    finally:
        await fetcher.close()
        thread.close()


def test_queue_size_flags_set_every_work_queue() -> None:
    config = _worker("--queue-max-msgs", "64", "--queue-max-bytes", "1048576").common.pipeline
    assert (config.request_queue_limits.max_msgs, config.hop_limits.max_bytes) == (64, 1 << 20)
    with pytest.raises(SettingError, match="must be positive"):
        _worker("--queue-max-msgs", "0")
