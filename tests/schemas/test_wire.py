from __future__ import annotations

import msgspec
import pytest

from schemas.chunk import ErrorChunk, FinishReason, ReplyChunk, TokenChunk, TokenLogprob, TopLogprob, Usage
from schemas.codec import JSON, MSGPACK, Decoder, encode
from schemas.control import Cancel, DeadLetter
from schemas.errors import ErrorCode, TooLarge
from schemas.processed import KvHandoff, MediaItem, MediaKind, ProcessedRequest
from schemas.request import ChatMessage, GenerateRequest, ImageParams, ImagePart, ImageURL, SamplingParams, TextPart
from schemas.routes import route_for
from schemas.tensors import TensorRef

REQUEST = GenerateRequest(
    request_id="r1",
    model="tiny-qwen2-vl",
    messages=[
        ChatMessage(role="system", content="be brief"),
        ChatMessage(role="user", content=[ImagePart(ImageURL("data:image/png;base64,AAAA")), TextPart("what?")]),
    ],
    sampling=SamplingParams(max_tokens=8, temperature=0.0, stop=["\n"], seed=7, logprobs=2),
    deadline=123.5,
    route=["encode+prefill+decode"],
)


@pytest.mark.parametrize("content_type", [MSGPACK, JSON])
def test_every_message_round_trips(content_type: str) -> None:
    messages: list[tuple[object, object]] = [
        (REQUEST, GenerateRequest),
        (
            ProcessedRequest(
                request=REQUEST,
                prompt_token_ids=[1, 2, 3],
                media=[MediaItem(MediaKind.IMAGE, "data:x", 1)],
                route=["encode+prefill+decode"],
                max_tokens=8,
                seed=7,
            ),
            ProcessedRequest,
        ),
        (TokenChunk("r1", 3, [5, 6], "hi", FinishReason.STOP, Usage(10, 5)), ReplyChunk),
        (
            TokenChunk(
                "r1",
                0,
                [5],
                "h",
                logprobs=[TokenLogprob(5, "h", -0.25, [TopLogprob(5, "h", -0.25), TopLogprob(9, "\u00e9", -2.5)])],
            ),
            ReplyChunk,
        ),
        (ErrorChunk.from_error("r1", TooLarge("big")), ReplyChunk),
        (Cancel("r1"), Cancel),
        (DeadLetter("s", ErrorCode.INVALID_MEDIA, "bad", 1, "r1", b"\x00\x01"), DeadLetter),
    ]
    for message, type_ in messages:
        assert Decoder(type_).decode(encode(message, content_type), content_type) == message


def test_json_is_accepted_without_a_header() -> None:
    raw = b'{"request_id":"r2","model":"m","messages":[{"role":"user","content":"hi"}]}'
    decoded = Decoder(GenerateRequest).decode(raw, None)
    assert decoded.messages[0].content == "hi"
    assert decoded.sampling == SamplingParams()


def test_error_chunk_carries_code_and_status() -> None:
    chunk = ErrorChunk.from_error("r1", TooLarge("12 images"))
    assert (chunk.code, chunk.http_status, chunk.retryable) == (ErrorCode.TOO_LARGE, 413, False)
    assert msgspec.json.decode(encode(chunk, JSON))["kind"] == "error"


def test_unknown_fields_and_wrong_types_are_named() -> None:
    decoder = Decoder(GenerateRequest)
    with pytest.raises(msgspec.ValidationError, match="bogus"):
        decoder.decode(b'{"request_id":"r","model":"m","messages":[],"bogus":1}', JSON)
    with pytest.raises(msgspec.ValidationError, match=r"\$.sampling.max_tokens"):
        decoder.decode(b'{"request_id":"r","model":"m","messages":[],"sampling":{"max_tokens":"x"}}', JSON)


def test_routes_of_every_mode() -> None:
    assert route_for("epd", True) == ["encode+prefill+decode"]
    assert route_for("e-p-d", True) == ["encode", "prefill", "decode"]
    assert route_for("e-p-d", False) == ["prefill", "decode"]
    assert route_for("ep-d", False) == ["encode+prefill", "decode"]
    with pytest.raises(ValueError, match="unknown mode"):
        route_for("pd", True)


def test_a_message_without_inline_media_keeps_everything_but_their_bytes() -> None:
    from schemas.processed import MediaItem, MediaKind, ProcessedRequest
    from schemas.request import (
        AudioPart,
        AudioURL,
        ChatMessage,
        GenerateRequest,
        ImagePart,
        ImageURL,
        InputAudio,
        InputAudioPart,
        TextPart,
    )

    content = [
        TextPart("Look:"),
        ImagePart(ImageURL("data:image/png;base64,AAAA", detail="high")),
        ImagePart(ImageURL("https://example.com/a.png")),
        InputAudioPart(InputAudio("UklGRg==", "wav")),
        AudioPart(AudioURL("data:audio/wav;base64,UklGRg==")),
    ]
    request = GenerateRequest("r", "m", [ChatMessage("user", content)])
    media = [
        MediaItem(MediaKind.IMAGE, "", 1, part=[0, 1]),
        MediaItem(MediaKind.IMAGE, "https://example.com/a.png", 2),
        MediaItem(MediaKind.AUDIO, "data:", 3, format="wav", part=[0, 3]),
        MediaItem(MediaKind.AUDIO, "", 4, part=[0, 4]),
    ]
    message = ProcessedRequest(request, [1, 2, 3, 4, 5], media, ["encode", "prefill"], 4, 7, bridge_restarts=True)
    light = message.without_inline_media()
    assert light.media_dropped and not message.media_dropped
    parts = light.request.messages[0].content
    assert isinstance(parts, list)
    assert parts[0] == TextPart("Look:")
    assert parts[1] == ImagePart(ImageURL("", detail="high"))
    assert parts[2] == content[2]  # a URL is no inline bytes: kept
    assert parts[3] == InputAudioPart(InputAudio("", "wav"))
    assert parts[4] == AudioPart(AudioURL(""))
    assert (light.media, light.prompt_token_ids, light.seed, light.route) == (media, [1, 2, 3, 4, 5], 7, message.route)
    assert message.request.messages[0].content == content  # the original is untouched


def test_after_the_text_the_message_goes_to_the_image_stage_with_it() -> None:
    asked = GenerateRequest("r", "m", [ChatMessage("user", "Paint the sea.")], image=ImageParams())
    kv = KvHandoff(TensorRef("nixl", "holder", "k", 0, [], 0.0), prompt_len=9, output_ids=[4])
    route = ["encode", "prefill", "decode", "generate-image"]
    at_prefill = ProcessedRequest(asked, [1, 2], [], route, 8, 3, hop_index=1, emitted=[7], kv=kv)
    after = at_prefill.after_text("a blue sea")
    assert after is not None and (after.hop, after.stage_text) == ("generate-image", "a blue sea")
    assert after.kv is None and after.emitted == [] and after.seed == 3  # the seed stays: the same image on a redraw
    assert after.restarted().stage_text == "" and after.restarted().hop_index == 0
    assert ProcessedRequest(asked, [1], [], ["encode+prefill+decode"], 8, 3).after_text("x") is None
    # The stage's text and the image's parameters travel with the message.
    assert Decoder(ProcessedRequest).decode(encode(after)) == after
