"""Video and audio on every family that takes them: greedy tokens equal
transformers generate() exactly, in one engine and across a KV hand-off,
and Qwen-VL's video positions equal transformers' own rope index."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from schemas.errors import UnsupportedMedia
from schemas.processed import MediaKind
from stages.families import Media
from stages.media import MediaPolicy, VideoOptions, decode_audio, decode_video
from stages.models import builtin_path
from stages.torch_engine.engine import TorchEngine
from stages.torch_engine.reference import load_reference_model, reference_generate
from tests.stages.engine_helpers import chat_prompt, decode, engine_on, greedy
from tests.stages.test_media_av import encode_audio, encode_video

N_NEW = 10
POLICY = MediaPolicy()


def noise(seed: int) -> Any:
    def frame(i: int, size: tuple[int, int]) -> np.ndarray:
        return np.random.default_rng(seed * 1000 + i).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)

    return frame


def video(engine: TorchEngine, seed: int = 1, frames: int = 12, **options: Any) -> Media:
    data = encode_video(n=frames, size=(96, 64), fps=6, frames=noise(seed))
    pad = engine.family.video_frame_multiple
    return decode_video(data, POLICY, VideoOptions(pad_to_multiple=pad, **options))


def audio(seconds: float, freq: float = 440.0) -> Media:
    rng = np.random.default_rng(int(freq))
    data = encode_audio("WAV", "FLOAT", rate=22_050, seconds=seconds, channels=1)
    decoded = decode_audio(data, POLICY)
    # Noise on top of the sine so two clips differ in more than pitch.
    samples = decoded.samples + rng.standard_normal(len(decoded.samples)).astype(np.float32) * 0.05
    return type(decoded)(samples, decoded.duration_s)


def image(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (70, 90, 3), dtype=np.uint8))


@pytest.fixture(
    scope="module", params=["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-llava-next-video", "tiny-qwen2-audio"]
)
def loaded(
    request: pytest.FixtureRequest, mmpipe_home: Path, engine_device: str
) -> tuple[str, Path, TorchEngine, TorchEngine, Any]:
    model_dir = builtin_path(request.param)
    engine, other = engine_on(engine_device, model_dir), engine_on(engine_device, model_dir)
    return request.param, model_dir, engine, other, load_reference_model(model_dir, device=engine_device)


def _cases(name: str, engine: TorchEngine) -> dict[str, list[Media]]:
    if name == "tiny-qwen2-audio":
        return {"one audio": [audio(1.5)], "two audios": [audio(2.0, 300.0), audio(0.7, 900.0)]}
    cases = {
        "video by num_frames": [video(engine, num_frames=4)],
        "video by fps": [video(engine, fps=3.0)],
        "two videos": [video(engine, 1, num_frames=4), video(engine, 2, num_frames=4)],
    }
    if name != "tiny-llava-next-video":
        cases["image, video, image"] = [image(3), video(engine, 3, num_frames=6), image(4)]
    return cases


def _prompt(engine: TorchEngine, media: list[Media]) -> list[int]:
    kinds = [MediaKind.IMAGE if isinstance(m, Image.Image) else MediaKind.VIDEO for m in media]
    kinds = [MediaKind.AUDIO if type(m).__name__ == "DecodedAudio" else k for m, k in zip(media, kinds, strict=True)]
    content: list[dict[str, str]] = [{"type": k.value, k.value: ""} for k in kinds]
    content.append({"type": "text", "text": "What happens here?"})
    return chat_prompt(engine, content)


def test_every_case_equals_generate_in_one_engine_and_across_a_hand_off(loaded: Any) -> None:
    name, model_dir, engine, other, ref_model = loaded
    outputs = set()
    for case, media in _cases(name, engine).items():
        prompt = _prompt(engine, media)
        expected = reference_generate(model_dir, prompt, media, N_NEW, model=ref_model)
        encoded = engine.encode(media)
        assert [e.kind for e in encoded] == [e.kind for e in engine.encode(media)], case
        [(seq, first)] = engine.prefill([prompt], [encoded], [greedy(N_NEW)])
        assert decode(engine, seq, first, N_NEW) == expected, case
        [(seq, first)] = engine.prefill([prompt], [encoded], [greedy(N_NEW)])
        tensors, state = engine.export_kv(seq)
        engine.release(seq)
        moved = other.import_kv([t.clone() for t in tensors], state, greedy(N_NEW))
        assert decode(other, moved, first, N_NEW) == expected, case
        outputs.add(tuple(expected))
    # The media reach the model: different inputs, different outputs.
    assert len(outputs) == len(_cases(name, engine))


def test_a_kind_the_family_does_not_run_is_refused(loaded: Any) -> None:
    name, _, engine, _, _ = loaded
    wrong: Media = audio(1.0) if name != "tiny-qwen2-audio" else image(1)
    with pytest.raises(UnsupportedMedia, match="not supported"):
        engine.encode([wrong])


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-qwen2.5-vl"])
@pytest.mark.parametrize(("frames", "options"), [(40, {"num_frames": 20}), (12, {"fps": 5.0}), (12, {"num_frames": 5})])
def test_video_positions_equal_transformers_rope_index(
    mmpipe_home: Path, name: str, frames: int, options: dict[str, Any]
) -> None:
    """Long videos (more temporal steps than the grid is wide) and sampling
    rates whose grid steps are fractions of a second, image beside them.
    Index arithmetic: on the CPU whatever --engine-device says."""
    model_dir = builtin_path(name)
    engine = TorchEngine(model_dir)
    ref_model = load_reference_model(model_dir)
    get_rope_index = ref_model.model.get_rope_index
    if "mm_token_type_ids" not in inspect.signature(get_rope_index).parameters:
        pytest.skip("get_rope_index of this transformers release has another signature")
    clip = decode_video(
        encode_video(n=frames, size=(56, 56), fps=6, frames=noise(7)),
        POLICY,
        VideoOptions(pad_to_multiple=2, **options),
    )
    media = [clip, image(2)]
    encoded = engine.encode(media)
    ids = engine.family.expand_placeholders(_prompt(engine, media), encoded)
    positions, delta = engine.family.prompt_positions(ids, encoded)
    input_ids = torch.tensor([ids])
    ids_of = engine.family.placeholder_ids
    types = (input_ids == ids_of[MediaKind.IMAGE]).int() + 2 * (input_ids == ids_of[MediaKind.VIDEO]).int()
    kwargs: dict[str, Any] = {}
    if name == "tiny-qwen2.5-vl":
        kwargs["second_per_grid_ts"] = torch.tensor([encoded[0].seconds_per_grid])
    ref_positions, ref_delta = get_rope_index(
        input_ids,
        mm_token_type_ids=types,
        image_grid_thw=torch.tensor([encoded[1].grid_thw]),
        video_grid_thw=torch.tensor([encoded[0].grid_thw]),
        **kwargs,
    )
    assert encoded[0].grid_thw[0] == (len(clip.frames) + 1) // 2
    assert torch.equal(positions, ref_positions)
    assert delta == int(ref_delta)
