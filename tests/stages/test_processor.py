from __future__ import annotations

from pathlib import Path

import pytest

from schemas.errors import ContextLengthExceeded, InvalidRequest, ModelNotFound, TooLarge, UnsupportedMedia
from schemas.request import ChatMessage, GenerateRequest, ImagePart, ImageURL, SamplingParams, TextPart
from stages.models import resolve_model
from stages.models.traits import load_traits
from stages.processor import Processor, ProcessorLimits


@pytest.fixture(scope="module")
def processor(tiny_model_dir: Path) -> Processor:
    return Processor(load_traits(resolve_model(str(tiny_model_dir), "tiny")), mode="epd")


def req(*parts: TextPart | ImagePart, **sampling: object) -> GenerateRequest:
    return GenerateRequest(
        request_id="r",
        model="tiny",
        messages=[ChatMessage("user", list(parts))],
        sampling=SamplingParams(**sampling),  # type: ignore[arg-type]
    )


IMG = ImagePart(ImageURL("data:image/png;base64,AAAA"))


def test_one_placeholder_per_image_where_the_image_was(processor: Processor) -> None:
    out = processor.process(req(TextPart("first"), IMG, TextPart("then"), IMG, max_tokens=5))
    pad = processor.model.image_token_id
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
        (req(*[IMG] * 9), TooLarge, "9 images"),
        (req(ImagePart(ImageURL("ftp://x/y.png"))), UnsupportedMedia, "scheme"),
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
