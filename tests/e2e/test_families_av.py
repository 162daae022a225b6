"""Video and audio through the bridge with the official openai client, on
every family that takes them, in every mode: exactly generate()'s text."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import REGISTRY
from transformers import AutoTokenizer

from pipeline.config import PipelineConfig
from stages.media import MediaPolicy, VideoOptions, decode_audio, decode_video
from stages.models import builtin_path, resolve_model
from stages.torch_engine.reference import load_reference_model, reference_generate
from tests.e2e.conftest import N, ask, client, gradient, png_data_url, start_stack
from tests.stages.test_media_av import encode_audio, encode_video

MODES = ["epd", "e-pd", "e-p-d", "ep-d"]
POLICY = MediaPolicy()


def _noise(seed: int) -> Any:
    def frame(i: int, size: tuple[int, int]) -> np.ndarray:
        return np.random.default_rng(seed * 1000 + i).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)

    return frame


def _mp4(seed: int) -> bytes:
    return encode_video(n=12, size=(96, 64), fps=6, frames=_noise(seed))


def _wav(seconds: float) -> bytes:
    return encode_audio("WAV", "PCM_16", rate=22_050, seconds=seconds, channels=2)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


class Reference:
    """generate() on a built-in, for content as the openai client sends it."""

    def __init__(self, name: str) -> None:
        self.dir = builtin_path(name)
        self.model = load_reference_model(self.dir)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.dir))
        config = self.model.config
        # Qwen-VL pads a video to whole temporal patches; the others take any frame count.
        qwen_vl = config.model_type in ("qwen2_vl", "qwen2_5_vl")
        self.pad = int(config.vision_config.temporal_patch_size) if qwen_vl else 1

    def __call__(self, content: list[dict[str, Any]], sources: list[Any]) -> str:
        return str(self.tokenizer.decode(self.tokens(content, sources), skip_special_tokens=True))

    def tokens(self, content: list[dict[str, Any]], sources: list[Any], n: int = N, exactly: bool = False) -> list[int]:
        """generate()'s greedy tokens (``exactly``: n of them, EOS or not)."""
        parts: list[dict[str, Any]] = []
        media: list[Any] = []
        given = iter(sources)
        for part in content:
            if part["type"] == "text":
                parts.append(part)
            elif part["type"] == "video_url":
                options = {k: v for k, v in part["video_url"].items() if k != "url"}
                media.append(decode_video(next(given), POLICY, VideoOptions(pad_to_multiple=self.pad, **options)))
                parts.append({"type": "video", "video": ""})
            elif part["type"] in ("input_audio", "audio_url"):
                media.append(decode_audio(next(given), POLICY))
                parts.append({"type": "audio", "audio": ""})
            else:
                media.append(next(given))
                parts.append({"type": "image", "image": ""})
        messages = [{"role": "user", "content": parts}]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        min_new = n if exactly else None
        return reference_generate(self.dir, prompt, media, max_new_tokens=n, min_new_tokens=min_new, model=self.model)


def _video_then_image() -> tuple[list[dict[str, Any]], list[Any]]:
    video, picture = _mp4(1), gradient(40, 72, 5)
    content = [
        {"type": "video_url", "video_url": {"url": f"data:video/mp4;base64,{_b64(video)}", "num_frames": 4}},
        {"type": "image_url", "image_url": {"url": png_data_url(picture)}},
        {"type": "text", "text": "What changes?"},
    ]
    return content, [video, picture]


def _video_by_fps() -> tuple[list[dict[str, Any]], list[Any]]:
    video = _mp4(2)
    part = {"type": "video_url", "video_url": {"url": f"data:video/mp4;base64,{_b64(video)}", "fps": 3.0}}
    return [part, {"type": "text", "text": "Describe it."}], [video]


def _two_audios() -> tuple[list[dict[str, Any]], list[Any]]:
    one, two = _wav(1.2), _wav(0.6)
    content = [
        {"type": "input_audio", "input_audio": {"data": _b64(one), "format": "wav"}},
        {"type": "text", "text": "and"},
        {"type": "audio_url", "audio_url": {"url": f"data:audio/wav;base64,{_b64(two)}"}},
    ]
    return content, [one, two]


def _skipped() -> float:
    return REGISTRY.get_sample_value("mmpipe_encoder_skipped_items_total") or 0.0


CASES = {
    "tiny-qwen2.5-vl": [_video_then_image, _video_by_fps],
    "tiny-qwen2-vl": [_video_by_fps],
    "tiny-llava-next-video": [_video_by_fps],
    "tiny-qwen2-audio": [_two_audios],
}


@pytest.fixture(scope="module", params=list(CASES))
def family(request: pytest.FixtureRequest, mmpipe_home: Path) -> tuple[str, Reference]:
    return request.param, Reference(request.param)


@pytest.mark.e2e
@pytest.mark.parametrize("mode", MODES)
async def test_video_and_audio_equal_generate_in_every_mode(
    pipeline_config: PipelineConfig, family: tuple[str, Reference], mode: str
) -> None:
    name, reference = family
    config = PipelineConfig(nats_url=pipeline_config.nats_url, namespace=pipeline_config.namespace, mode=mode)
    stack, stop = await start_stack(config, resolve_model(name), modalities="image,video,audio")
    try:
        async with client(stack) as c:
            for make in CASES[name]:
                content, sources = make()
                expected = reference(content, sources)
                assert await ask(c, content, stream=True, model=name) == (expected, N)
            # A repeat of the last one, with the same answer, is not encoded again: an
            # embedding cache hit, or (where the encoding worker prefills into a pool
            # of its own) its media's tokens found in the prefix cache.
            skipped = _skipped()
            assert await ask(c, content, stream=False, model=name) == (expected, N)
            skipped = _skipped() - skipped
        [encoder] = [w for w in stack.workers if "encode" in w.role.split("+")]
        stats = encoder.stage.engine.encoder.cache.stats()  # type: ignore[attr-defined]
        assert (stats["hits"] + (skipped > 0), stats["misses"]) == (1, len(CASES[name]))
    finally:
        await stop()
