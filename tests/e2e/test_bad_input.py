"""The bad input corpus (issue 5, item 4): every entry goes through the real
stack, the bridge with the official client (raw aiohttp where the body itself
is malformed) or NATS directly, and must get its documented status and stable
``code``. No worker dies (a good request still succeeds afterwards and every
worker task is alive), and each bad request that reached a worker is on the
dead subject exactly once, after one delivery, with nothing left to redeliver.

One stack per module (a default deployment, ``--modalities
image,video,audio``), plus a second namespace on the same nats-server run as
with ``--allow-internal-media`` for the cases that need a loopback media
server (redirect chains). No case ever sends traffic beyond loopback: every
non-loopback address here must be refused before any connection.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gzip
import io
import math
import random
import struct
import time
import urllib.parse
import uuid
import wave
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import openai
import pytest
import pytest_asyncio
from aiohttp import web
from PIL import Image

from pipeline.config import PipelineConfig, StreamLimits
from pipeline.nats_server import NatsServer, NatsServerConfig
from schemas.chunk import ErrorChunk
from schemas.codec import CONTENT_TYPE, JSON, MSGPACK, Decoder
from schemas.control import DeadLetter
from schemas.errors import MmpipeError
from schemas.processed import ProcessedRequest
from schemas.request import GenerateRequest, SamplingParams
from stages.media.audio import decode_audio
from stages.media.policy import MediaPolicy
from stages.media.video import decode_video
from stages.models import ModelSpec, resolve_model
from tests.e2e.conftest import N, Stack, ask, client, gradient, serve_on_loopback, start_stack

MODEL = "tiny-qwen2-vl"
AUDIO_MODEL = "tiny-qwen2-audio"
EPD = "encode+prefill+decode"
ROLES = ("processor", EPD)

# -- payloads ------------------------------------------------------------------------------------


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


GOOD_PNG = _png(gradient(32, 32, 3))


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` over a few bytes of pixels."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"\0" * 64)) + _chunk(b"IEND", b"")
    )


def _png_bomb() -> bytes:
    """A real decompression bomb: 7000x7000 black pixels (49 Mpx) in ~48 KB."""
    return _png(Image.new("L", (7000, 7000)))


# SOF0 claiming 65535x65535, then a scan: nothing to decode, everything to allocate.
JPEG_HUGE = (
    b"\xff\xd8\xff\xc0\x00\x11\x08\xff\xff\xff\xff\x03\x01\x22\x00\x02\x11\x01\x03\x11\x01"
    b"\xff\xda\x00\x08\x01\x01\x00\x00\x3f\x00"
)
# WebP VP8X (extended) header claiming 16384x16384.
WEBP_HUGE = b"RIFF\x1e\x00\x00\x00WEBPVP8X\x0a\x00\x00\x00\x00\x00\x00\x00" + (16383).to_bytes(3, "little") * 2

HTML = b"<!doctype html><html><script>fetch('http://169.254.169.254/')</script></html>"
SVG = b'<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg" onload="alert(1)"><rect/></svg>'
PDF = b"%PDF-1.7\n1 0 obj << /Type /Catalog >> endobj\n%%EOF\n"


def _gif() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="GIF")
    return buf.getvalue()


# Polyglots: a GIF that is also a ZIP (GIFAR); PNG magic in front of an HTML page;
# a PDF that carries a JPEG; a valid PNG with a ZIP appended (decodes as the PNG).
GIFAR = _gif() + b"PK\x03\x04" + b"\0" * 26 + b"PK\x05\x06" + b"\0" * 18
PNG_MAGIC_HTML = b"\x89PNG\r\n\x1a\n" + HTML
PDF_JPEG = PDF + JPEG_HUGE
PNG_ZIP = GOOD_PNG + b"PK\x03\x04" + b"\0" * 26 + b"PK\x05\x06" + b"\0" * 18

# Damaged media: the first 40 bytes of a PNG; one byte of its pixel data inverted.
PNG_TRUNCATED = GOOD_PNG[:40]
PNG_CORRUPT = GOOD_PNG[:60] + bytes([GOOD_PNG[60] ^ 0xFF]) + GOOD_PNG[61:]
# An MP4 ftyp box, then a moov box whose size runs far past the end of the data;
# a WAV whose RIFF and fmt chunks are garbage.
MP4_CORRUPT = b"\x00\x00\x00\x18ftypisom\x00\x00\x02\x00isomiso2" + b"\x00\x10\x00\x00moov" + bytes(range(256)) * 4
WAV_CORRUPT = b"RIFF\xff\xff\xff\x7fWAVEfmt \x10\x00\x00\x00" + b"\xff" * 40


def _wav(seconds: float, rate: int = 16_000) -> bytes:
    """Mono 16-bit PCM: a 440 Hz tone."""
    frames = int(seconds * rate)
    samples = (int(8000 * math.sin(2 * math.pi * 440 * i / rate)) for i in range(frames))
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"".join(struct.pack("<h", v) for v in samples))
    return buf.getvalue()


GOOD_WAV = _wav(1.0)


def _input_audio(data: bytes | str, fmt: str = "wav") -> dict[str, Any]:
    b64 = data if isinstance(data, str) else base64.b64encode(data).decode()
    return {"type": "input_audio", "input_audio": {"data": b64, "format": fmt}}


def _audio_url(url: str) -> dict[str, Any]:
    return {"type": "audio_url", "audio_url": {"url": url}}


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image(url: str, text: str = "What is this?") -> list[dict[str, Any]]:
    return [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]


# -- what one case does --------------------------------------------------------------------------


@dataclass
class Env:
    # By name: "main" (a default deployment of tiny-qwen2-vl, every modality
    # on), "internal" (the same, run as with --allow-internal-media) and
    # "audio" (tiny-qwen2-audio), each in its own namespace.
    stacks: dict[str, Stack]
    dead: dict[str, DeadLetters]
    # The loopback media server the internal stack may fetch from.
    media_url: str

    @property
    def stack(self) -> Stack:
        return self.stacks["main"]


@dataclass
class Sent:
    """What a case got back, and how to find its dead letters."""

    status: int | None
    code: str | None
    request_id: str = ""
    # For messages with no readable request id: the dead letter carries the bytes.
    payload: bytes | None = None
    subject: str = ""


Send = Callable[[Env], Awaitable[Sent]]


@dataclass(frozen=True)
class Case:
    id: str
    send: Send
    status: int | None
    code: str | None
    # Dead letters the case must leave (0: refused before any worker saw it),
    # and the role that must have written it.
    dead: int
    dead_role: str = "processor"
    on: str = "main"
    xfail: str | None = None


def chat(content: Any, on: str = "main", role: str = "user", **kw: Any) -> Send:
    """The official client, non-streaming; ``kw`` are create() arguments (extra_body too).
    ``content`` may be a function that makes it, for payloads too costly to build at import."""

    async def send(env: Env) -> Sent:
        stack = env.stacks[on]
        made = content() if callable(content) else content
        args: dict[str, Any] = {"model": stack.spec.served_name, "max_tokens": 2, **kw}
        async with client(stack) as c:
            try:
                r = await c.chat.completions.create(messages=[{"role": role, "content": made}], **args)
            except openai.APIStatusError as exc:
                body = exc.body if isinstance(exc.body, dict) else {}
                return Sent(exc.status_code, body.get("code"), request_id=exc.request_id or "")
        return Sent(200, None, request_id=r.id)

    return send


def chat_stream(content: Any, **kw: Any) -> Send:
    """The official client, streaming: an error before the first token is a plain HTTP error."""

    async def send(env: Env) -> Sent:
        async with client(env.stack) as c:
            try:
                s = await c.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": content}], stream=True, max_tokens=2, **kw
                )
                async for _ in s:
                    pass
            except openai.APIStatusError as exc:
                body = exc.body if isinstance(exc.body, dict) else {}
                return Sent(exc.status_code, body.get("code"), request_id=exc.request_id or "")
        return Sent(200, None)

    return send


def raw(body: bytes | Callable[[], bytes], content_type: str = "application/json") -> Send:
    """A raw POST, for bodies the official client would never send."""

    async def send(env: Env) -> Sent:
        data = body() if callable(body) else body
        async with aiohttp.ClientSession() as http:
            async with http.post(
                f"{env.stack.base_url}/v1/chat/completions",
                # A stream, not bytes: aiohttp warns that a large bytes body blocks the loop.
                data=io.BytesIO(data),
                headers={"Content-Type": content_type},
            ) as r:
                payload = await r.json()
                assert set(payload) == {"error"} and set(payload["error"]) >= {"message", "type", "code"}
                return Sent(r.status, payload["error"]["code"], request_id=r.headers.get("X-Request-Id", ""))

    return send


def _request(rid: str, **kw: Any) -> dict[str, Any]:
    """A GenerateRequest as a plain dict, so a case can break it any way it likes."""
    body: dict[str, Any] = {
        "request_id": rid,
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "sampling": {"max_tokens": 2},
    }
    body.update(kw)
    return body


def nats(
    make: Callable[[str], bytes | dict[str, Any] | msgspec.Struct],
    content_type: str | None = MSGPACK,
    hop: str | None = None,
    reply: bool = True,
    rid: str | None = None,
    own_reply_subject: bool = False,
) -> Send:
    """Publish on mmpipe.<ns>.requests (or a hop's subject) as a NATS-native
    caller would, and read the error chunk from the reply subject.

    ``reply=False``: the message has no usable request id, so nobody can be
    told; only its dead letter (found by its bytes) shows what happened.
    """

    async def send(env: Env) -> Sent:
        stack = env.stack
        subjects = stack.config.subjects
        request_id = rid if rid is not None else f"bad-{uuid.uuid4().hex}"
        made = make(request_id)
        reply_subject = subjects.reply(request_id)
        if own_reply_subject:
            assert isinstance(made, dict)
            reply_subject = made["reply_subject"] = f"_INBOX.bad.{uuid.uuid4().hex}"
        if isinstance(made, bytes):
            data = made
        elif isinstance(made, dict) and content_type == JSON:
            data = msgspec.json.encode(made)
        else:
            data = msgspec.msgpack.encode(made)
        nc, js = stack.nc, stack.nc.jetstream()
        sub = await nc.subscribe(reply_subject) if reply else None
        subject = subjects.work(hop) if hop else subjects.requests
        headers = {CONTENT_TYPE: content_type} if content_type else None
        try:
            await js.publish(subject, data, headers=headers)
            if sub is None:
                return Sent(None, None, request_id=request_id, payload=data, subject=subject)
            msg = await sub.next_msg(timeout=30)
            chunk = Decoder(ErrorChunk).decode(msg.data, (msg.headers or {}).get(CONTENT_TYPE))
            assert chunk.request_id == request_id
            return Sent(chunk.http_status, chunk.code.value, request_id=request_id, payload=data, subject=subject)
        finally:
            if sub is not None:
                await sub.unsubscribe()

    return send


# -- dead letters ---------------------------------------------------------------------------------


class DeadLetters:
    """Everything on the dead stream, read incrementally."""

    def __init__(self, js: Any, stream: str) -> None:
        self.js = js
        self.stream = stream
        self.letters: list[DeadLetter] = []
        self._next = 1
        self._decoder = Decoder(DeadLetter)

    async def refresh(self) -> list[DeadLetter]:
        last = (await self.js.stream_info(self.stream)).state.last_seq
        while self._next <= last:
            msg = await self.js.get_msg(self.stream, self._next)
            self.letters.append(self._decoder.decode(msg.data))
            self._next += 1
        return self.letters

    async def of(self, sent: Sent, expected: int, within_s: float = 15.0) -> list[DeadLetter]:
        def mine(d: DeadLetter) -> bool:
            if sent.payload is not None and d.payload == sent.payload:
                return True
            return bool(sent.request_id) and d.request_id == sent.request_id

        deadline = time.monotonic() + within_s
        while True:
            found = [d for d in await self.refresh() if mine(d)]
            if len(found) >= expected or time.monotonic() > deadline:
                return found
            await asyncio.sleep(0.05)


async def assert_nothing_pending(stack: Stack) -> None:
    """Nothing left to redeliver: the work queues are empty, nothing awaits an ack."""
    js = stack.nc.jetstream()
    subjects = stack.config.subjects
    deadline = time.monotonic() + 10
    while True:
        state = {}
        for role in ROLES:
            info = await js.consumer_info(subjects.stream(role), subjects.durable(role))
            messages = (await js.stream_info(subjects.stream(role))).state.messages
            state[role] = (messages, info.num_ack_pending, info.num_redelivered, info.num_pending)
        if all(v == (0, 0, 0, 0) for v in state.values()) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    assert all(v == (0, 0, 0, 0) for v in state.values()), state


# -- the corpus -----------------------------------------------------------------------------------


def _noise_png(nbytes: int) -> bytes:
    """A valid PNG of about ``nbytes`` (noise does not compress)."""
    side = int((nbytes / 3) ** 0.5) + 1
    return _png(Image.frombytes("RGB", (side, side), random.Random(5).randbytes(side * side * 3)))


def _nine_images() -> list[dict[str, Any]]:
    return [{"type": "image_url", "image_url": {"url": data_url(GOOD_PNG)}} for _ in range(9)] + [
        {"type": "text", "text": "Compare them."}
    ]


def _at_max_payload(rid: str) -> bytes:
    """A request (its image is zeros) whose message is 150 bytes under the server's max_payload."""
    limit = NatsServerConfig(data_dir=Path()).max_payload

    def make(n: int) -> bytes:
        return msgspec.msgpack.encode(
            _request(rid, messages=[{"role": "user", "content": image("data:image/png;base64," + "A" * n)}])
        )

    n = limit - 150 - len(make(0))
    n -= len(make(n)) - (limit - 150)  # the string's length header grew
    data = make(n - n % 4)
    assert limit - 160 < len(data) <= limit - 150
    return data


def _processed(rid: str, **kw: Any) -> ProcessedRequest:
    request = GenerateRequest(request_id=rid, model=MODEL, messages=[], sampling=SamplingParams(max_tokens=2))
    base: dict[str, Any] = {
        "request": request,
        "prompt_token_ids": [1, 2, 3],
        "media": [],
        "route": [EPD],
        "max_tokens": 2,
        "seed": 1,
    }
    base.update(kw)
    return ProcessedRequest(**base)


def _video(url: str, **sampling: Any) -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": url, **sampling}}


def _hops(n: int, to: str) -> str:
    """A path on the media server that redirects ``n`` times on loopback, then to ``to``."""
    return f"/hop/{n}?to={urllib.parse.quote(to, safe='')}"


def internal_chat(path: str, **kw: Any) -> Send:
    """An image URL on the loopback media server, through the allow-internal stack."""

    async def send(env: Env) -> Sent:
        return await chat(image(env.media_url + path), on="internal", **kw)(env)

    return send


CORPUS: list[Case] = [
    # Damaged and hostile images (encode worker).
    Case("png-truncated", chat(image(data_url(PNG_TRUNCATED))), 400, "invalid_media", 1, EPD),
    Case("png-corrupt-idat", chat(image(data_url(PNG_CORRUPT))), 400, "invalid_media", 1, EPD),
    Case("png-zero-size", chat(image(data_url(_png_claiming(0, 0)))), 400, "invalid_media", 1, EPD),
    Case("png-bomb-7000x7000-in-48kb", chat(lambda: image(data_url(_png_bomb()))), 413, "too_large", 1, EPD),
    Case(
        "png-header-claims-100000x100000", chat(image(data_url(_png_claiming(10**5, 10**5)))), 413, "too_large", 1, EPD
    ),
    Case("jpeg-sof-claims-65535x65535", chat(image(data_url(JPEG_HUGE, "image/jpeg"))), 413, "too_large", 1, EPD),
    Case("webp-vp8x-claims-16384x16384", chat(image(data_url(WEBP_HUGE, "image/webp"))), 413, "too_large", 1, EPD),
    # Wrong MIME type: the bytes decide, never the label.
    Case("html-labelled-png", chat(image(data_url(HTML))), 400, "invalid_media", 1, EPD),
    Case("svg-with-script-labelled-png", chat(image(data_url(SVG))), 422, "unsupported_media", 1, EPD),
    Case("gif-labelled-jpeg", chat(image(data_url(_gif(), "image/jpeg"))), 422, "unsupported_media", 1, EPD),
    Case("png-labelled-text-plain-is-fine", chat(image(data_url(GOOD_PNG, "text/plain"))), 200, None, 0),
    # Polyglots.
    Case("polyglot-gifar", chat(image(data_url(GIFAR))), 422, "unsupported_media", 1, EPD),
    Case("polyglot-png-magic-then-html", chat(image(data_url(PNG_MAGIC_HTML))), 400, "invalid_media", 1, EPD),
    Case("polyglot-pdf-with-jpeg", chat(image(data_url(PDF_JPEG, "image/jpeg"))), 422, "unsupported_media", 1, EPD),
    Case("polyglot-png-plus-zip-decodes-as-png", chat(image(data_url(PNG_ZIP))), 200, None, 0),
    # Malformed data: URLs.
    Case("data-url-no-comma", chat(image("data:image/png;base64")), 400, "invalid_media", 1, EPD),
    Case("data-url-not-base64", chat(image("data:image/png,\x89PNG")), 400, "invalid_media", 1, EPD),
    Case("data-url-bad-base64", chat(image("data:image/png;base64,@@not-base64@@")), 400, "invalid_media", 1, EPD),
    Case("data-url-empty-payload", chat(image("data:image/png;base64,")), 400, "invalid_media", 1, EPD),
    Case("image-url-empty", chat(image("")), 400, "invalid_request", 0),
    # SSRF: every one refused before a connection is attempted.
    Case("ssrf-loopback-plain-http", chat(image("http://127.0.0.1:9/x.png")), 400, "url_not_allowed", 1, EPD),
    Case("ssrf-loopback-https", chat(image("https://127.0.0.1/x.png")), 400, "url_not_allowed", 1, EPD),
    Case("ssrf-loopback-v6", chat(image("https://[::1]/x.png")), 400, "url_not_allowed", 1, EPD),
    Case("ssrf-v4-mapped-v6-loopback", chat(image("https://[::ffff:127.0.0.1]/x.png")), 400, "url_not_allowed", 1, EPD),
    Case("ssrf-decimal-ipv4", chat(image("https://2130706433/x.png")), 400, "url_not_allowed", 1, EPD),
    Case("ssrf-private-10", chat(image("https://10.1.2.3/x.png")), 400, "url_not_allowed", 1, EPD),
    Case("ssrf-private-192-168", chat(image("https://192.168.0.1/x.png")), 400, "url_not_allowed", 1, EPD),
    Case("ssrf-link-local", chat(image("https://169.254.10.20/x.png")), 400, "url_not_allowed", 1, EPD),
    Case("ssrf-metadata", chat(image("https://169.254.169.254/latest/meta-data/")), 400, "url_not_allowed", 1, EPD),
    Case("ssrf-unspecified", chat(image("https://0.0.0.0/x.png")), 400, "url_not_allowed", 1, EPD),
    # A name (not an address) that resolves to loopback: refused by the resolver, unconnected.
    Case(
        "ssrf-hostname-resolving-to-loopback", chat(image("https://localhost:9/x.png")), 400, "url_not_allowed", 1, EPD
    ),
    Case("ssrf-file-url", chat(image("file:///etc/passwd")), 400, "url_not_allowed", 1, EPD),
    Case("ssrf-gopher-scheme", chat(image("gopher://127.0.0.1:70/_x")), 422, "unsupported_media", 1),
    # Redirect chains from a loopback server (the allow-internal stack).
    Case(
        "redirect-chain-to-metadata",
        internal_chat(_hops(2, "http://169.254.169.254/latest/meta-data/")),
        400,
        "url_not_allowed",
        1,
        EPD,
        on="internal",
    ),
    Case(
        "redirect-chain-to-v6-mapped-metadata",
        internal_chat(_hops(1, "http://[::ffff:169.254.169.254]/")),
        400,
        "url_not_allowed",
        1,
        EPD,
        on="internal",
    ),
    Case(
        "redirect-to-file-url",
        internal_chat(_hops(1, "file:///etc/passwd")),
        400,
        "url_not_allowed",
        1,
        EPD,
        on="internal",
    ),
    Case("redirect-loop", internal_chat("/loop"), 400, "media_fetch_failed", 1, EPD, on="internal"),
    Case("http-404", internal_chat("/missing.png"), 400, "media_fetch_failed", 1, EPD, on="internal"),
    Case("html-served-as-image-png", internal_chat("/html"), 400, "invalid_media", 1, EPD, on="internal"),
    Case("gzip-bomb-over-http", internal_chat("/gzip-bomb"), 413, "too_large", 1, EPD, on="internal"),
    # Oversize bodies.
    Case("body-over-32mib", raw(lambda: b'{"x":"' + b"a" * (33 * 1024 * 1024) + b'"}'), 413, "too_large", 0),
    Case(
        "request-over-nats-max-payload",
        chat(lambda: image(data_url(b"\x89PNG\r\n\x1a\n" + b"\0" * (10 * 1024 * 1024)))),
        413,
        "too_large",
        0,
    ),
    Case(
        "valid-5mib-png-within-image-cap",
        chat(lambda: image(data_url(_noise_png(5 * 1024 * 1024)))),
        200,
        None,
        0,
    ),
    # Malformed JSON, unknown fields, wrong types (the bridge).
    Case("json-malformed", raw(b'{"model": "tiny-qwen2-vl", "messages": [}'), 400, "invalid_request", 0),
    Case("json-not-an-object", raw(b"[1, 2, 3]"), 400, "invalid_request", 0),
    Case("json-empty-body", raw(b""), 400, "invalid_request", 0),
    Case("json-not-utf8", raw(b'{"model": "\xff\xfe"}'), 400, "invalid_request", 0),
    Case("unknown-top-level-field", chat("hi", extra_body={"temprature": 0.5}), 400, "invalid_request", 0),
    Case("unknown-part-type", chat([{"type": "hologram", "hologram": {}}]), 400, "invalid_request", 0),
    Case(
        "unknown-field-in-video-part",
        chat([{"type": "video_url", "video_url": {"url": "x", "fps": 1, "bogus": 1}}]),
        400,
        "invalid_request",
        0,
    ),
    Case("wrong-type-messages", raw(b'{"model": "tiny-qwen2-vl", "messages": "hi"}'), 400, "invalid_request", 0),
    Case("wrong-type-text-part", chat([{"type": "text", "text": 42}]), 400, "invalid_request", 0),
    Case("wrong-type-max-tokens", chat("hi", max_tokens="many"), 400, "invalid_request", 0),
    Case(
        "wrong-type-stream",
        raw(b'{"model": "tiny-qwen2-vl", "messages": [], "stream": "yes"}'),
        400,
        "invalid_request",
        0,
    ),
    Case("missing-model", raw(b'{"messages": [{"role": "user", "content": "hi"}]}'), 400, "invalid_request", 0),
    Case("unknown-model", chat("hi", model="gpt-17"), 404, "model_not_found", 0),
    Case("n-zero", chat("hi", n=0), 400, "invalid_request", 0),
    Case("n-over-128", chat("hi", n=129), 400, "invalid_request", 0),
    Case("top-logprobs-without-logprobs", chat("hi", top_logprobs=2), 400, "invalid_request", 0),
    Case("top-logprobs-over-20", chat("hi", logprobs=True, top_logprobs=21), 400, "invalid_request", 0),
    Case("file-part", chat([{"type": "file", "file": {"file_id": "f"}}]), 422, "unsupported_media", 0),
    Case("empty-messages", raw(b'{"model": "tiny-qwen2-vl", "messages": []}'), 400, "invalid_request", 1),
    Case("unknown-role", chat("hi", role="wizard"), 400, "invalid_request", 1),
    # Too many media items, too long prompts.
    Case("nine-images", chat(_nine_images), 413, "too_large", 1),
    Case("prompt-over-the-context", chat("hello " * 5000), 400, "context_length_exceeded", 1),
    Case("prompt-over-max-prompt-tokens", chat("hello " * 40000), 413, "too_large", 1),
    Case(
        "image-placeholder-in-text", chat("<|vision_start|><|image_pad|><|vision_end|> hi"), 400, "invalid_request", 1
    ),
    # Invalid sampling values.
    Case("temperature-negative", chat("hi", temperature=-0.5), 400, "invalid_request", 1),
    Case("temperature-over-2", chat("hi", temperature=7.0), 400, "invalid_request", 1),
    Case("temperature-string", chat("hi", temperature="hot"), 400, "invalid_request", 0),
    Case("top-p-zero", chat("hi", top_p=0.0), 400, "invalid_request", 1),
    Case("top-p-over-1", chat("hi", top_p=1.5), 400, "invalid_request", 1),
    Case("top-k-negative", chat("hi", extra_body={"top_k": -1}), 400, "invalid_request", 1),
    Case("top-k-float", chat("hi", extra_body={"top_k": 2.5}), 400, "invalid_request", 0),
    Case("max-tokens-zero", chat("hi", max_tokens=0), 400, "invalid_request", 1),
    Case("max-tokens-negative", chat("hi", max_tokens=-5), 400, "invalid_request", 1),
    Case("max-tokens-beyond-context", chat("hi", max_tokens=10**7), 400, "context_length_exceeded", 1),
    Case("max-tokens-over-uint64", chat("hi", max_tokens=2**70), 400, "invalid_request", 0),
    Case(
        "min-tokens-over-max-tokens", chat("hi", max_tokens=2, extra_body={"min_tokens": 5}), 400, "invalid_request", 1
    ),
    Case("min-tokens-negative", chat("hi", extra_body={"min_tokens": -1}), 400, "invalid_request", 1),
    Case("seed-negative", chat("hi", seed=-1), 400, "invalid_request", 1),
    Case("seed-2-pow-63", chat("hi", seed=2**63), 400, "invalid_request", 1),
    Case("seed-over-uint64", chat("hi", seed=2**64), 400, "invalid_request", 0),
    Case("stop-nine-strings", chat("hi", stop=[f"s{i}" for i in range(9)]), 400, "invalid_request", 1),
    Case("stop-wrong-type", chat("hi", stop=7), 400, "invalid_request", 0),
    Case("streamed-bad-sampling", chat_stream("hi", temperature=-1.0), 400, "invalid_request", 1),
    # Video and audio. Qwen2-VL takes video: the encode worker decodes it and
    # refuses what is corrupt or foreign. It takes no audio: the processor
    # refuses that with 422 before anything is fetched.
    Case(
        "video-corrupt-mp4",
        chat([{"type": "video_url", "video_url": {"url": data_url(MP4_CORRUPT, "video/mp4")}}]),
        400,
        "invalid_media",
        1,
        EPD,
    ),
    Case(
        "video-not-base64",
        chat([{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,%%%"}}]),
        400,
        "invalid_media",
        1,
        EPD,
    ),
    Case("video-html-labelled-mp4", chat([_video(data_url(HTML, "video/mp4"))]), 422, "unsupported_media", 1, EPD),
    Case("video-png-labelled-mp4", chat([_video(data_url(GOOD_PNG, "video/mp4"))]), 422, "unsupported_media", 1, EPD),
    Case(
        "video-num-frames-and-fps",
        chat([_video(data_url(MP4_CORRUPT, "video/mp4"), num_frames=4, fps=1.0)]),
        400,
        "invalid_request",
        1,
        EPD,
    ),
    Case(
        "video-num-frames-zero",
        chat([_video(data_url(MP4_CORRUPT, "video/mp4"), num_frames=0)]),
        400,
        "invalid_request",
        1,
        EPD,
    ),
    Case(
        "video-num-frames-over-cap",
        chat([_video(data_url(MP4_CORRUPT, "video/mp4"), num_frames=10_000)]),
        413,
        "too_large",
        1,
        EPD,
    ),
    Case("video-ssrf-metadata", chat([_video("https://169.254.169.254/v.mp4")]), 400, "url_not_allowed", 1, EPD),
    Case(
        "video-num-frames-over-uint64",
        chat([_video(data_url(MP4_CORRUPT, "video/mp4"), num_frames=2**70)]),
        400,
        "invalid_request",
        0,
    ),
    Case(
        "audio-corrupt-wav-input-audio",
        chat(
            [{"type": "input_audio", "input_audio": {"data": base64.b64encode(WAV_CORRUPT).decode(), "format": "wav"}}]
        ),
        422,
        "unsupported_media",
        1,
    ),
    Case(
        "audio-corrupt-audio-url",
        chat([{"type": "audio_url", "audio_url": {"url": data_url(WAV_CORRUPT, "audio/wav")}}]),
        422,
        "unsupported_media",
        1,
    ),
    Case(
        "audio-format-not-a-name",
        chat([{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "../wav"}}]),
        400,
        "invalid_request",
        1,
    ),
    # Audio on a model that takes it (tiny-qwen2-audio): the encode worker decodes it.
    Case("audio-corrupt-wav", chat([_input_audio(WAV_CORRUPT)], on="audio"), 400, "invalid_media", 1, EPD, on="audio"),
    Case(
        "audio-url-corrupt-wav",
        chat([_audio_url(data_url(WAV_CORRUPT, "audio/wav"))], on="audio"),
        400,
        "invalid_media",
        1,
        EPD,
        on="audio",
    ),
    Case(
        "audio-png-declared-wav", chat([_input_audio(GOOD_PNG)], on="audio"), 400, "invalid_media", 1, EPD, on="audio"
    ),
    Case(
        "audio-bad-base64", chat([_input_audio("@@not base64@@")], on="audio"), 400, "invalid_media", 1, EPD, on="audio"
    ),
    Case(
        "audio-pdf-as-audio-url",
        chat([_audio_url(data_url(PDF, "audio/wav"))], on="audio"),
        422,
        "unsupported_media",
        1,
        EPD,
        on="audio",
    ),
    Case(
        "audio-format-not-supported",
        chat([_input_audio(GOOD_WAV, fmt="mp4")], on="audio"),
        422,
        "unsupported_media",
        1,
        EPD,
        on="audio",
    ),
    Case(
        "audio-31s-over-30s-cap",
        chat(lambda: [_input_audio(_wav(31.0, rate=8000))], on="audio"),
        413,
        "too_large",
        1,
        EPD,
        on="audio",
    ),
    Case(
        "audio-url-ssrf-private",
        chat([_audio_url("https://10.0.0.1/a.wav")], on="audio"),
        400,
        "url_not_allowed",
        1,
        EPD,
        on="audio",
    ),
    Case(
        "image-on-an-audio-model", chat(image(data_url(GOOD_PNG)), on="audio"), 422, "unsupported_media", 1, on="audio"
    ),
    # Straight onto NATS: malformed msgpack and JSON, bad GenerateRequests.
    Case("nats-garbage-bytes", nats(lambda rid: b"\xc1\xc1\xc1 not msgpack", reply=False), None, "invalid_request", 1),
    Case(
        "nats-truncated-msgpack",
        nats(lambda rid: msgspec.msgpack.encode(_request(rid))[:-7], reply=False),
        None,
        "invalid_request",
        1,
    ),
    Case("nats-msgpack-not-a-map", nats(lambda rid: [1, 2, 3], reply=False), None, "invalid_request", 1),
    Case(
        "nats-json-malformed",
        nats(lambda rid: b'{"request_id": "x", "model": ', content_type=JSON, reply=False),
        None,
        "invalid_request",
        1,
    ),
    Case(
        "nats-json-no-content-type",
        nats(lambda rid: msgspec.json.encode(_request(rid, sampling={"temperature": 9.0})), content_type=None),
        400,
        "invalid_request",
        1,
    ),
    Case("nats-unknown-field", nats(lambda rid: _request(rid, priority="high")), 400, "invalid_request", 1),
    Case(
        "nats-wrong-type-max-tokens",
        nats(lambda rid: _request(rid, sampling={"max_tokens": "ten"})),
        400,
        "invalid_request",
        1,
    ),
    Case(
        "nats-wrong-type-messages",
        nats(lambda rid: _request(rid, messages={"role": "user"})),
        400,
        "invalid_request",
        1,
    ),
    Case(
        "nats-temperature-nan",
        nats(lambda rid: _request(rid, sampling={"temperature": float("nan")})),
        400,
        "invalid_request",
        1,
    ),
    Case(
        "nats-top-p-inf", nats(lambda rid: _request(rid, sampling={"top_p": float("inf")})), 400, "invalid_request", 1
    ),
    Case(
        "nats-seed-over-int64", nats(lambda rid: _request(rid, sampling={"seed": 2**64 - 1})), 400, "invalid_request", 1
    ),
    Case("nats-unknown-hop-in-route", nats(lambda rid: _request(rid, route=["teleport"])), 400, "invalid_request", 1),
    Case("nats-unknown-model", nats(lambda rid: _request(rid, model="gpt-17")), 404, "model_not_found", 1),
    Case("nats-deadline-passed", nats(lambda rid: _request(rid, deadline=1.0)), 504, "deadline_exceeded", 1),
    Case(
        "nats-too-many-images",
        nats(lambda rid: _request(rid, messages=[{"role": "user", "content": _nine_images()}])),
        413,
        "too_large",
        1,
    ),
    Case(
        "nats-request-id-with-subject-wildcards",
        nats(_request, rid="a.b.*.>", reply=False),
        None,
        "invalid_request",
        1,
    ),
    Case(
        "nats-bad-request-id-own-reply-subject",
        nats(_request, rid="has space", own_reply_subject=True),
        400,
        "invalid_request",
        1,
    ),
    # Just under NATS's max_payload: the processor's message to the next hop
    # cannot be that small, and the dead letter keeps the record, not the bytes.
    Case("nats-request-at-max-payload", nats(_at_max_payload, content_type=None), 413, "too_large", 1),
    # Straight onto a hop's queue.
    Case("nats-hop-garbage", nats(lambda rid: b"\x93\x01\x02", hop=EPD, reply=False), None, "invalid_request", 1, EPD),
    Case(
        "nats-hop-index-out-of-range",
        nats(lambda rid: _processed(rid, hop_index=5), hop=EPD),
        400,
        "invalid_request",
        1,
        EPD,
    ),
    Case(
        "nats-hop-wrong-role",
        nats(lambda rid: _processed(rid, route=["decode"]), hop=EPD),
        400,
        "invalid_request",
        1,
        EPD,
    ),
]


# -- the stacks -----------------------------------------------------------------------------------


def media_app() -> web.Application:
    """The loopback media server of the allow-internal stack."""
    bomb = gzip.compress(b"\0" * (25 * 1024 * 1024), compresslevel=9)

    async def hop(request: web.Request) -> web.Response:
        n = int(request.match_info["n"])
        to = request.query["to"]
        raise web.HTTPFound(to if n == 0 else f"/hop/{n - 1}?to={urllib.parse.quote(to, safe='')}")

    async def loop(request: web.Request) -> web.Response:
        raise web.HTTPFound("/loop")

    async def html(request: web.Request) -> web.Response:
        return web.Response(body=HTML, content_type="image/png")

    async def gzip_bomb(request: web.Request) -> web.Response:
        return web.Response(body=bomb, content_type="image/png", headers={"Content-Encoding": "gzip"})

    async def ok(request: web.Request) -> web.Response:
        return web.Response(body=GOOD_PNG, content_type="image/png")

    app = web.Application()
    app.router.add_get("/hop/{n}", hop)
    app.router.add_get("/loop", loop)
    app.router.add_get("/html", html)
    app.router.add_get("/gzip-bomb", gzip_bomb)
    app.router.add_get("/ok.png", ok)
    return app


@pytest.fixture(scope="module")
def module_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    server = NatsServer(NatsServerConfig(data_dir=tmp_path_factory.mktemp("nats"), port=0))
    server.start()
    yield server
    server.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env(module_nats: NatsServer, tiny_model_dir: Path) -> AsyncIterator[Env]:
    spec: ModelSpec = resolve_model(str(tiny_model_dir), MODEL)
    config = PipelineConfig(nats_url=module_nats.url, namespace=f"t{uuid.uuid4().hex[:10]}")
    plans = {
        "main": (spec, False),
        "internal": (spec, True),
        "audio": (resolve_model(AUDIO_MODEL), False),
    }
    stacks: dict[str, Stack] = {}
    async with contextlib.AsyncExitStack() as later:
        for name, (model, allow_internal) in plans.items():
            # Every work-queue stream reserves its max_bytes from the server's
            # JetStream file limit: three namespaces at the default would not fit.
            limits = StreamLimits(max_bytes=64 << 20)
            config = PipelineConfig(
                nats_url=module_nats.url,
                namespace=f"t{uuid.uuid4().hex[:10]}",
                requests_limits=limits,
                hop_limits=limits,
            )
            stacks[name], stop = await start_stack(
                config, model, allow_internal=allow_internal, modalities="image,video,audio"
            )
            later.push_async_callback(stop)
        media_url = await later.enter_async_context(serve_on_loopback(media_app()))
        dead = {
            name: DeadLetters(stack.nc.jetstream(), stack.config.subjects.dead_stream) for name, stack in stacks.items()
        }
        yield Env(stacks=stacks, dead=dead, media_url=media_url)


# -- the tests ------------------------------------------------------------------------------------


def _params() -> list[Any]:
    params = []
    for case in CORPUS:
        marks = [pytest.mark.xfail(strict=True, reason=case.xfail)] if case.xfail else []
        params.append(pytest.param(case, id=case.id, marks=marks))
    return params


@pytest.mark.e2e
@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("case", _params())
async def test_bad_input(env: Env, case: Case) -> None:
    sent = await case.send(env)
    stack = env.stacks[case.on]
    dead = await env.dead[case.on].of(sent, case.dead)
    if sent.status is None and len(dead) == 1:
        # Nobody could be told (no usable request id): the dead letter says what happened.
        sent.code = dead[0].code.value
    assert (sent.status, sent.code) == (case.status, case.code)
    assert len(dead) == case.dead, dead
    subject = sent.subject or stack.config.subjects.work(case.dead_role)
    for letter in dead:
        assert (letter.code.value, letter.deliveries, letter.subject) == (case.code, 1, subject)
    await assert_nothing_pending(stack)


@pytest.mark.e2e
@pytest.mark.asyncio(loop_scope="module")
async def test_the_stacks_still_serve_after_the_corpus(env: Env) -> None:
    media = {
        "main": image(data_url(GOOD_PNG)),
        "internal": image(env.media_url + "/ok.png"),
        "audio": [_input_audio(GOOD_WAV), {"type": "text", "text": "What is this?"}],
    }
    for name, stack in env.stacks.items():
        assert all(not task.done() for task in stack.tasks), [t for t in stack.tasks if t.done()]
        assert all(w.handled > 0 for w in stack.workers), [(w.role, w.handled) for w in stack.workers]
        async with client(stack) as c:
            for content in ("Say something.", media[name]):
                for stream in (False, True):
                    _, usage = await ask(c, content, stream=stream, model=stack.spec.served_name)
                    assert usage == N
        await assert_nothing_pending(stack)
    # Each dead request is there once, after one delivery: nothing was redelivered.
    for letters in env.dead.values():
        all_letters = await letters.refresh()
        assert all(d.deliveries == 1 for d in all_letters)
        ids = [d.request_id for d in all_letters if d.request_id]
        assert len(ids) == len(set(ids))
        anonymous = [d.payload for d in all_letters if not d.request_id]
        assert len(anonymous) == len(set(anonymous))


@pytest.mark.parametrize(
    ("kind", "data", "fmt", "code"),
    [
        ("video", MP4_CORRUPT, None, "invalid_media"),
        ("video", MP4_CORRUPT[:30], None, "invalid_media"),
        ("video", HTML, None, "unsupported_media"),
        ("audio", WAV_CORRUPT, "wav", "invalid_media"),
        ("audio", GOOD_PNG, "wav", "invalid_media"),
        ("audio", PDF, None, "unsupported_media"),
    ],
    ids=["mp4-corrupt", "mp4-cut", "html-as-video", "wav-corrupt", "png-declared-wav", "pdf-as-audio"],
)
def test_corpus_video_and_audio_bytes_are_classified_by_the_decoders(
    kind: str, data: bytes, fmt: str | None, code: str
) -> None:
    """What an encode worker whose family takes video or audio answers for the
    corpus's bytes (where the family does not, the processor refuses them first)."""
    policy = MediaPolicy()
    with pytest.raises(MmpipeError) as info:
        if kind == "video":
            decode_video(data, policy)
        else:
            decode_audio(data, policy, fmt)
    assert info.value.code.value == code
