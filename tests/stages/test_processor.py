from __future__ import annotations

import dataclasses
from pathlib import Path

import msgspec
import pytest

from schemas.errors import ContextLengthExceeded, InvalidRequest, ModelNotFound, TooLarge, UnsupportedMedia
from schemas.processed import MediaKind
from schemas.request import (
    ChatMessage,
    ChoiceGroup,
    GenerateRequest,
    ImagePart,
    ImageURL,
    InputAudio,
    InputAudioPart,
    SamplingParams,
    TextPart,
    VideoPart,
    VideoURL,
)
from stages.models import resolve_model
from stages.models.traits import load_traits
from stages.processor import Processor, ProcessorLimits


@pytest.fixture(scope="module")
def processor(tiny_model_dir: Path) -> Processor:
    return Processor(load_traits(resolve_model(str(tiny_model_dir), "tiny")), mode="epd")


def req(*parts: TextPart | ImagePart | VideoPart | InputAudioPart, **sampling: object) -> GenerateRequest:
    return GenerateRequest(
        request_id="r",
        model="tiny",
        messages=[ChatMessage("user", list(parts))],
        sampling=SamplingParams(**sampling),  # type: ignore[arg-type]
    )


IMG = ImagePart(ImageURL("data:image/png;base64,AAAA"))


def test_one_placeholder_per_image_where_the_image_was(processor: Processor) -> None:
    out = processor.process(req(TextPart("first"), IMG, TextPart("then"), IMG, max_tokens=5))
    pad = processor.model.placeholders[MediaKind.IMAGE]
    assert [m.placeholder_index for m in out.media] == [i for i, t in enumerate(out.prompt_token_ids) if t == pad]
    assert len(out.media) == 2
    text = processor.model.tokenizer.decode(out.prompt_token_ids)
    assert text.index("first") < text.index("<|image_pad|>") < text.index("then")
    assert text.endswith("<|im_start|>assistant\n")
    assert out.route == ["encode+prefill+decode"] and out.max_tokens == 5


def test_route_follows_the_mode_and_text_only_skips_encode(tiny_model_dir: Path) -> None:
    traits = load_traits(resolve_model(str(tiny_model_dir), "tiny"))
    assert Processor(traits, mode="e-p-d").process(req(IMG)).route == ["encode", "prefill", "decode"]
    assert Processor(traits, mode="e-p-d").process(req(TextPart("hi"))).route == ["prefill", "decode"]
    with pytest.raises(ValueError, match="unknown mode"):
        Processor(traits, mode="nope")


def test_seed_is_fixed_per_request(processor: Processor) -> None:
    assert processor.process(req(TextPart("hi"), seed=42)).seed == 42
    a, b = processor.process(req(TextPart("hi"))), processor.process(req(TextPart("hi")))
    assert a.seed != b.seed


@pytest.mark.parametrize(
    ("request_", "error", "match"),
    [
        (req(TextPart("hi"), max_tokens=10**6), ContextLengthExceeded, "exceeds the context"),
        (req(TextPart("hi"), max_tokens=0), InvalidRequest, "at least 1"),
        (req(TextPart("hi"), temperature=-1.0), InvalidRequest, "temperature"),
        (req(TextPart("hi"), top_p=0.0), InvalidRequest, "top_p"),
        (req(TextPart("hi"), min_tokens=9, max_tokens=3), InvalidRequest, "min_tokens"),
        (req(TextPart("<|image_pad|>")), InvalidRequest, "placeholder"),
        (req(*[IMG] * 9), TooLarge, "9 image items"),
        (req(ImagePart(ImageURL("ftp://x/y.png"))), UnsupportedMedia, "scheme"),
        (msgspec.structs.replace(req(TextPart("hi")), group=ChoiceGroup("g", 0)), InvalidRequest, "group.size"),
        (msgspec.structs.replace(req(TextPart("hi")), group=ChoiceGroup("g", 129)), InvalidRequest, "group.size"),
    ],
)
def test_limits_and_bad_values(
    processor: Processor, request_: GenerateRequest, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        processor.process(request_)


def test_unknown_model_and_bad_roles(processor: Processor) -> None:
    with pytest.raises(ModelNotFound):
        processor.process(GenerateRequest("r", "other", [ChatMessage("user", "hi")]))
    with pytest.raises(InvalidRequest, match="role"):
        processor.process(GenerateRequest("r", "tiny", [ChatMessage("robot", "hi")]))
    with pytest.raises(InvalidRequest, match="only accepted in user"):
        processor.process(GenerateRequest("r", "tiny", [ChatMessage("assistant", [IMG])]))
    with pytest.raises(InvalidRequest, match="empty"):
        processor.process(GenerateRequest("r", "tiny", []))


def test_prompt_length_limit(tiny_model_dir: Path) -> None:
    traits = load_traits(resolve_model(str(tiny_model_dir), "tiny"))
    small = Processor(traits, limits=ProcessorLimits(max_prompt_tokens=20))
    with pytest.raises(TooLarge, match="prompt of"):
        small.process(req(TextPart("word " * 50)))


VIDEO = VideoPart(VideoURL("data:video/mp4;base64,AAAA", fps=1.0))
AUDIO = InputAudioPart(InputAudio("UklGRg==", "wav"))


def test_a_disabled_modality_is_refused_with_422(processor: Processor) -> None:
    with pytest.raises(UnsupportedMedia, match=r"content\[1\]: video input is not enabled on this deployment"):
        processor.process(req(TextPart("see"), VIDEO))
    with pytest.raises(UnsupportedMedia, match="audio input is not enabled"):
        processor.process(req(AUDIO))
    assert UnsupportedMedia.http_status == 422


def test_an_enabled_modality_the_model_cannot_take_is_refused(tiny_model_dir: Path) -> None:
    traits = load_traits(resolve_model(str(tiny_model_dir), "tiny"))
    everything = Processor(traits, modalities=frozenset(MediaKind))
    with pytest.raises(UnsupportedMedia, match="model 'tiny' takes image, video input, not audio"):
        everything.process(req(AUDIO))
    assert len(everything.process(req(IMG, TextPart("ok"))).media) == 1


def test_media_items_carry_kind_and_options(tiny_model_dir: Path) -> None:
    traits = load_traits(resolve_model(str(tiny_model_dir), "tiny"))
    # A model that takes all three (as Qwen2-Audio-style adapters will declare).
    ids = traits.tokenizer.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>", "<|AUDIO|>"])
    pretend = dataclasses.replace(
        traits, placeholders={MediaKind.IMAGE: ids[0], MediaKind.VIDEO: ids[1], MediaKind.AUDIO: ids[2]}
    )
    # Qwen2-VL's template renders images and videos (not audio).
    out = Processor(pretend, modalities=frozenset(MediaKind)).process(req(VIDEO, IMG, TextPart("?")))
    assert [m.kind for m in out.media] == [MediaKind.VIDEO, MediaKind.IMAGE]
    assert out.media[0].fps == 1.0 and out.media[0].num_frames is None
    assert [out.prompt_token_ids[m.placeholder_index] for m in out.media] == ids[:2][::-1]
    with pytest.raises(TooLarge, match="3 video items"):
        Processor(pretend, modalities=frozenset(MediaKind)).process(req(VIDEO, VIDEO, VIDEO))


def test_a_completions_prompt_is_taken_as_it_is(processor: Processor) -> None:
    tokenizer = processor.model.tokenizer
    text = "The sea and the mountains are"
    ids = [int(t) for t in tokenizer(text)["input_ids"]]
    by_text = processor.process(GenerateRequest("p1", "tiny", [], prompt=text))
    # No chat template: the text's own tokens (what the template would add is not there).
    assert by_text.prompt_token_ids == ids and by_text.media == [] and by_text.route == ["encode+prefill+decode"]
    assert processor.process(GenerateRequest("p2", "tiny", [], prompt=ids)).prompt_token_ids == ids
    image_pad = processor.model.placeholders[MediaKind.IMAGE]
    for bad, says in [
        (GenerateRequest("p3", "tiny", [ChatMessage("user", "hi")], prompt=text), "messages or a prompt"),
        (GenerateRequest("p4", "tiny", [], prompt=[len(tokenizer) + 5]), "outside the vocabulary"),
        (GenerateRequest("p5", "tiny", [], prompt=""), "empty"),
        (GenerateRequest("p6", "tiny", [], prompt=[*ids, image_pad]), "media placeholder tokens"),
    ]:
        with pytest.raises(InvalidRequest, match=says):
            processor.process(bad)


def test_a_messages_name_goes_to_the_chat_template(processor: Processor) -> None:
    messages, _ = processor._template_messages([ChatMessage("user", "hi", name="ann"), ChatMessage("user", "yo")])
    assert messages == [{"role": "user", "content": "hi", "name": "ann"}, {"role": "user", "content": "yo"}]


def _warm_up_failures() -> float:
    from stages.processor import WARM_UP_FAILURES

    return float(WARM_UP_FAILURES._value.get())


@pytest.mark.parametrize(
    ("modalities", "limits"),
    [
        (frozenset({MediaKind.IMAGE}), ProcessorLimits()),
        (frozenset(), ProcessorLimits()),  # images off: the warm-up sends none
        (frozenset({MediaKind.IMAGE}), ProcessorLimits(max_images=0)),
    ],
)
def test_the_warm_up_is_a_request_the_deployment_takes(
    processor: Processor, modalities: frozenset[MediaKind], limits: ProcessorLimits
) -> None:
    warm = Processor(processor.model, modalities=modalities, limits=limits)
    before = _warm_up_failures()
    warm.warm_up()
    assert _warm_up_failures() == before


def test_a_failed_warm_up_is_logged_and_counted_not_raised(processor: Processor) -> None:
    warm = Processor(processor.model)

    def broken(request: GenerateRequest) -> None:
        raise RuntimeError(f"no template for {request.request_id}")

    warm.process = broken  # type: ignore[method-assign,assignment]
    before = _warm_up_failures()
    warm.warm_up()
    assert _warm_up_failures() == before + 1
