"""stages.media: URL policy (SSRF guard), fetching and safe image decoding.

Everything network-facing runs against real aiohttp servers on loopback; hostnames are
mapped with a fake resolver so no test depends on outside DNS.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import functools
import gzip
import io
import ipaddress
import os
import socket
import struct
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.abc import AbstractResolver, ResolveResult
from PIL import Image, ImageOps
from yarl import URL

from schemas.errors import InvalidMedia, MediaFetchFailed, TooLarge, UnsupportedMedia, UrlNotAllowed
from stages.media import (
    MediaFetcher,
    MediaPolicy,
    PolicyResolver,
    address_block_reason,
    check_address,
    check_remote_url,
    decode_image,
    load_image,
    parse_data_url,
)

INTERNAL = MediaPolicy(allow_internal=True, fetch_timeout_s=5.0)
MiB = 1024 * 1024
# A video-sized payload: over the default (image) cap of 20 MiB, under video_max_bytes (64 MiB).
VIDEO_SIZED = 30 * MiB
# The gated body the tests of concurrent callers with different caps share.
GATED_BIG = 3 * MiB
SIZE = (32, 24)
RED = (200, 30, 30)


def encode(fmt: str, size: tuple[int, int] = SIZE, mode: str = "RGB", color: Any = RED, **save: Any) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, fmt, **save)
    return buf.getvalue()


PNG = encode("PNG")
JPEG = encode("JPEG", quality=95)
WEBP = encode("WEBP", lossless=True)
GIF = encode("GIF", mode="P", color=1)
BMP = encode("BMP")
TIFF = encode("TIFF")
SVG = b'<?xml version="1.0"?>\n<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>'


@functools.cache
def payload(size: int) -> bytes:
    """``size`` bytes of a repeating pattern, made once per size (the 30 MiB one is reused)."""
    return bytes(range(256)) * (size // 256) + bytes(size % 256)


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_bomb(width: int, height: int) -> bytes:
    """A valid-looking PNG that claims ``width`` x ``height``: a few dozen bytes on the wire."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 1024)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", idat) + png_chunk(b"IEND", b"")


def webp_bomb(width: int, height: int) -> bytes:
    """An extended (VP8X) WebP header claiming a ``width`` x ``height`` canvas."""
    vp8x = b"\x00\x00\x00\x00" + (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
    body = b"WEBP" + b"VP8X" + struct.pack("<I", len(vp8x)) + vp8x
    return b"RIFF" + struct.pack("<I", len(body)) + body


def assert_red_rgb(img: Image.Image, size: tuple[int, int] = SIZE) -> None:
    assert img.mode == "RGB"
    assert img.size == size
    pixel = img.getpixel((size[0] // 2, size[1] // 2))
    assert isinstance(pixel, tuple)
    assert all(abs(a - b) <= 8 for a, b in zip(pixel, RED, strict=True)), pixel


async def wait_until(pred: Callable[[], bool], within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


# -- servers and fetchers ------------------------------------------------------------------------


class ImageServer:
    """An aiohttp server on a loopback address, counting requests by path."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.hits: collections.Counter[str] = collections.Counter()
        self.release = asyncio.Event()
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def base(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url(self, path: str, host: str | None = None, scheme: str = "http") -> str:
        return f"{scheme}://{host or self.host}:{self.port}{path}"

    async def start(self) -> ImageServer:
        @web.middleware
        async def count(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> Any:
            self.hits[request.path] += 1
            return await handler(request)

        app = web.Application(middlewares=[count])
        app.router.add_get("/img.png", self._bytes(PNG, "image/png"))
        app.router.add_get("/img.jpg", self._bytes(JPEG, "image/jpeg"))
        app.router.add_get("/img.webp", self._bytes(WEBP, "image/webp"))
        app.router.add_get("/img.gif", self._bytes(GIF, "image/gif"))
        app.router.add_get("/text", self._bytes(b"hello, not an image", "text/plain"))
        app.router.add_get("/redirect/{n}", self._redirect_chain)
        app.router.add_get("/to", self._redirect_to)
        app.router.add_get("/slow", self._slow)
        app.router.add_get("/gated", self._gated)
        app.router.add_get("/huge", self._huge_chunked)
        app.router.add_get("/huge-cl", self._bytes(b"\x00" * (3 * 1024 * 1024), "image/png"))
        app.router.add_get("/gzip-bomb", self._gzip_bomb)
        app.router.add_get("/video-sized", self._video_sized)
        app.router.add_get("/video-sized-chunked", self._video_sized_chunked)
        app.router.add_get("/gated-big", self._gated_big)
        # handler_cancellation: a handler left waiting by a client that gave up ends with it.
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def close(self) -> None:
        self.release.set()
        if self._runner is not None:
            await self._runner.cleanup()

    @staticmethod
    def _bytes(body: bytes, content_type: str) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(request: web.Request) -> web.Response:
            return web.Response(body=body, content_type=content_type)

        return handler

    async def _redirect_chain(self, request: web.Request) -> web.Response:
        n = int(request.match_info["n"])
        if n == 0:
            return web.Response(body=PNG, content_type="image/png")
        # Relative Location: resolved against the current URL by the fetcher.
        raise web.HTTPFound(f"/redirect/{n - 1}")

    async def _redirect_to(self, request: web.Request) -> web.Response:
        raise web.HTTPFound(request.query["url"])

    async def _slow(self, request: web.Request) -> web.Response:
        await asyncio.sleep(30)
        return web.Response(body=PNG, content_type="image/png")

    async def _gated(self, request: web.Request) -> web.Response:
        await self.release.wait()
        return web.Response(body=PNG, content_type="image/png")

    async def _huge_chunked(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "image/png"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for _ in range(48):  # 3 MiB, no Content-Length
            await resp.write(b"\x00" * 65536)
        await resp.write_eof()
        return resp

    async def _video_sized(self, request: web.Request) -> web.Response:
        return web.Response(body=payload(VIDEO_SIZED), content_type="video/mp4")

    async def _video_sized_chunked(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "video/mp4"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        body = payload(VIDEO_SIZED)
        for at in range(0, len(body), MiB):
            await resp.write(body[at : at + MiB])
        await resp.write_eof()
        return resp

    async def _gated_big(self, request: web.Request) -> web.Response:
        await self.release.wait()
        return web.Response(body=payload(GATED_BIG), content_type="video/mp4")

    async def _gzip_bomb(self, request: web.Request) -> web.Response:
        body = gzip.compress(b"\x00" * (8 * 1024 * 1024))
        return web.Response(body=body, headers={"Content-Type": "image/png", "Content-Encoding": "gzip"})


@pytest.fixture
async def server() -> AsyncIterator[ImageServer]:
    srv = await ImageServer().start()
    yield srv
    await srv.close()


@pytest.fixture
async def make_fetcher() -> AsyncIterator[Callable[..., MediaFetcher]]:
    made: list[MediaFetcher] = []

    def make(policy: MediaPolicy | None = None, **kwargs: Any) -> MediaFetcher:
        fetcher = MediaFetcher(policy, **kwargs)
        made.append(fetcher)
        return fetcher

    yield make
    for fetcher in made:
        await fetcher.close()


class FakeResolver(AbstractResolver):
    """Maps test hostnames to fixed addresses; anything else fails like NXDOMAIN."""

    def __init__(self, names: dict[str, list[str]]) -> None:
        self.names = names
        self.calls: list[str] = []

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        self.calls.append(host)
        if host not in self.names:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [
            ResolveResult(
                hostname=host,
                host=addr,
                port=port,
                family=socket.AF_INET6 if ":" in addr else socket.AF_INET,
                proto=0,
                flags=socket.AI_NUMERICHOST,
            )
            for addr in self.names[host]
        ]

    async def close(self) -> None:
        pass


# -- address policy --------------------------------------------------------------------------------

BLOCKED = [
    "127.0.0.1",
    "127.255.0.9",
    "0.0.0.0",
    "10.1.2.3",
    "172.16.0.1",
    "172.31.255.254",
    "192.168.1.1",
    "169.254.1.1",
    "169.254.169.254",
    "100.64.0.1",
    "100.127.255.254",
    "100.100.100.200",
    "192.0.2.1",
    "198.18.0.1",
    "224.0.0.1",
    "239.255.255.250",
    "240.0.0.1",
    "255.255.255.255",
    "::",
    "::1",
    "fe80::1",
    "fe80::1%1",
    "fc00::1",
    "fd12:3456::1",
    "fd00:ec2::254",
    "ff02::1",
    "::ffff:127.0.0.1",
    "::ffff:10.0.0.1",
    "::ffff:169.254.169.254",
    "::ffff:100.64.0.1",
    "::7f00:1",  # IPv4-compatible loopback
    "64:ff9b::a00:1",  # NAT64 of 10.0.0.1
    "2002:a00:1::1",  # 6to4 of 10.0.0.1
    "2001:db8::1",
]

PUBLIC = ["8.8.8.8", "1.1.1.1", "93.184.215.14", "172.32.0.1", "100.128.0.1", "2606:4700:4700::1111"]
PUBLIC += ["::ffff:8.8.8.8", "64:ff9b::808:808"]


@pytest.mark.parametrize("addr", BLOCKED)
def test_internal_addresses_are_blocked(addr: str) -> None:
    policy = MediaPolicy()
    ip = ipaddress.ip_address(addr)
    assert address_block_reason(ip, policy) is not None
    with pytest.raises(UrlNotAllowed, match="not allowed"):
        check_address(ip, policy)


@pytest.mark.parametrize("addr", PUBLIC)
def test_public_addresses_are_allowed(addr: str) -> None:
    assert address_block_reason(ipaddress.ip_address(addr), MediaPolicy()) is None


def test_block_reasons_name_the_range() -> None:
    policy = MediaPolicy()

    def reason(addr: str) -> str | None:
        return address_block_reason(ipaddress.ip_address(addr), policy)

    assert reason("127.0.0.1") == "a loopback address"
    assert reason("10.0.0.1") == "a private address"
    assert reason("169.254.1.1") == "a link-local address"
    assert reason("100.64.0.1") == "a carrier-grade NAT (shared) address"
    assert reason("169.254.169.254") == "a cloud metadata address"
    assert reason("::ffff:127.0.0.1") == "a loopback address"


def test_allow_internal_permits_internal_but_never_metadata() -> None:
    for addr in ("127.0.0.1", "10.0.0.1", "192.168.0.1", "::1", "fc00::1", "100.64.0.1"):
        assert address_block_reason(ipaddress.ip_address(addr), INTERNAL) is None
    for addr in ("169.254.169.254", "fd00:ec2::254", "100.100.100.200", "::ffff:169.254.169.254"):
        assert address_block_reason(ipaddress.ip_address(addr), INTERNAL) == "a cloud metadata address"


def test_denied_networks_apply_even_with_allow_internal() -> None:
    policy = MediaPolicy(allow_internal=True, denied_networks=("10.0.0.0/8", "2001:db8::/32"))
    assert "denied network" in (address_block_reason(ipaddress.ip_address("10.9.9.9"), policy) or "")
    assert "denied network" in (address_block_reason(ipaddress.ip_address("::ffff:10.9.9.9"), policy) or "")
    assert "denied network" in (address_block_reason(ipaddress.ip_address("2001:db8::5"), policy) or "")
    assert address_block_reason(ipaddress.ip_address("192.168.0.1"), policy) is None


@pytest.mark.parametrize(
    "url",
    [
        "http://example.com/cat.png",  # plain http needs allow_internal
        "ftp://example.com/cat.png",
        "https://127.0.0.1/cat.png",
        "https://[::1]/cat.png",
        "https://[::ffff:127.0.0.1]/cat.png",
        "https://[::ffff:a9fe:a9fe]/latest/meta-data/",
        "https://169.254.169.254/latest/meta-data/",
        "https://100.100.100.200/latest/meta-data/",
        "https://[fd00:ec2::254]/latest/meta-data/",
        "https://10.0.0.1/cat.png",
        "https://100.64.0.1/cat.png",
        "https://[fe80::1]/cat.png",
        "https://2130706433/cat.png",  # 127.0.0.1 as one number
        "https://127.1/cat.png",
        "https://0x7f000001/cat.png",
        "https:///cat.png",
    ],
)
def test_remote_url_checks_refuse(url: str) -> None:
    with pytest.raises(UrlNotAllowed):
        check_remote_url(URL(url), MediaPolicy())


def test_remote_url_checks_pass_public_and_defer_hostnames() -> None:
    check_remote_url(URL("https://8.8.8.8/cat.png"), MediaPolicy())
    # Hostnames are judged by the resolver on the addresses actually used, not here.
    check_remote_url(URL("https://images.example.com/cat.png"), MediaPolicy())
    check_remote_url(URL("http://127.0.0.1:8080/cat.png"), INTERNAL)


def test_policy_validation() -> None:
    with pytest.raises(ValueError, match="allowed_formats"):
        MediaPolicy(allowed_formats=frozenset({"JPEG", "TIFF"}))
    with pytest.raises(ValueError):
        MediaPolicy(denied_networks=("not-a-cidr",))
    with pytest.raises(ValueError, match="max_bytes"):
        MediaPolicy(max_bytes=0)
    assert MediaPolicy(allowed_formats=frozenset({"png"})).allowed_formats == frozenset({"PNG"})


async def test_resolver_refuses_a_name_with_any_internal_answer() -> None:
    fake = FakeResolver({"mixed.test": ["93.184.215.14", "10.0.0.1"], "public.test": ["93.184.215.14"]})
    resolver = PolicyResolver(MediaPolicy(), fake)
    with pytest.raises(UrlNotAllowed, match=r"'mixed.test' resolves to 10\.0\.0\.1, which is a private address"):
        await resolver.resolve("mixed.test", 443)
    results = await resolver.resolve("public.test", 443)
    assert [r["host"] for r in results] == ["93.184.215.14"]
    await resolver.close()


# -- data: URLs and decoding ----------------------------------------------------------------------


@pytest.mark.parametrize(("data", "mime"), [(PNG, "image/png"), (JPEG, "image/jpeg"), (WEBP, "image/webp")])
async def test_data_url_images_load(make_fetcher: Callable[..., MediaFetcher], data: bytes, mime: str) -> None:
    img = await load_image(data_url(data, mime), make_fetcher())
    assert_red_rgb(img)


async def test_data_url_format_comes_from_the_bytes(make_fetcher: Callable[..., MediaFetcher]) -> None:
    fetcher = make_fetcher()
    assert_red_rgb(await load_image(data_url(JPEG, "image/png"), fetcher))
    assert_red_rgb(await load_image(data_url(PNG, ""), fetcher))
    assert_red_rgb(await load_image(data_url(WEBP, "application/octet-stream"), fetcher))


def test_data_url_lenient_encodings() -> None:
    b64 = base64.b64encode(PNG).decode()
    assert parse_data_url(f"DATA:image/png;BASE64,{b64}", 10**6).data == PNG
    assert parse_data_url(f"data:image/png;base64,{b64.rstrip('=')}", 10**6).data == PNG
    assert parse_data_url(f"data:image/png;base64,{b64.replace('+', '%2B').replace('/', '%2F')}", 10**6).data == PNG
    assert parse_data_url(f"data:image/png;base64,{base64.urlsafe_b64encode(PNG).decode()}", 10**6).data == PNG
    assert parse_data_url("data:image/png;base64,aGVs\nbG8=", 10**6).data == b"hello"
    assert parse_data_url("data:image/png;base64,aG\x1fVs\u3000bG8=", 10**6).data == b"hello"
    assert parse_data_url(f"data:image/png;base64,{b64}", 10**6).media_type == "image/png"


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("data:image/png;base64", "no ','"),
        ("data:image/png;base64iVBORw0KGgo", "no ','"),
        ("data:image/png;base64,!!!!", "bad base64"),
        ("data:image/png;base64,A", "bad base64"),
        ("data:image/png;base64,", "empty payload"),
        ("data:image/png,%89PNG", "base64"),
        ("data:image/png;charset=utf-8,hello", "base64"),
    ],
)
async def test_malformed_data_urls(make_fetcher: Callable[..., MediaFetcher], url: str, match: str) -> None:
    with pytest.raises(InvalidMedia, match=match) as info:
        await load_image(url, make_fetcher())
    assert info.value.http_status == 400


async def test_data_url_byte_cap(make_fetcher: Callable[..., MediaFetcher]) -> None:
    fetcher = make_fetcher(MediaPolicy(max_bytes=1000))
    with pytest.raises(TooLarge, match="1000 byte limit"):
        await fetcher.fetch(data_url(os.urandom(1001)))
    assert len(await fetcher.fetch(data_url(os.urandom(1000)))) == 1000
    # Refused from its length alone: a 16 MB string is never decoded.
    started = time.perf_counter()
    with pytest.raises(TooLarge):
        await fetcher.fetch("data:image/png;base64," + "A" * 16_000_000)
    assert time.perf_counter() - started < 1.0


async def test_data_url_per_call_byte_cap(make_fetcher: Callable[..., MediaFetcher]) -> None:
    fetcher = make_fetcher(MediaPolicy())
    url = data_url(payload(VIDEO_SIZED), "video/mp4")
    with pytest.raises(TooLarge, match=f"over the {20 * MiB} byte limit"):
        await fetcher.fetch(url)
    assert await fetcher.fetch(url, max_bytes=MediaPolicy().video_max_bytes) == payload(VIDEO_SIZED)
    # A per-call cap below the policy's holds too.
    with pytest.raises(TooLarge, match="1001 bytes, over the 1000 byte limit"):
        await fetcher.fetch(data_url(os.urandom(1001)), max_bytes=1000)


async def test_per_call_byte_cap_must_be_positive(make_fetcher: Callable[..., MediaFetcher]) -> None:
    fetcher = make_fetcher(INTERNAL)
    for cap in (0, -1):
        with pytest.raises(ValueError, match="max_bytes must be positive"):
            await fetcher.fetch(data_url(PNG), max_bytes=cap)


@pytest.mark.parametrize(
    "data", [b"", b"hello, not an image", os.urandom(64), b"\x00" * 100, b"RIFF\x00\x00\x00\x00WAVE"]
)
def test_non_image_bytes_are_invalid(data: bytes) -> None:
    with pytest.raises(InvalidMedia, match="not a recognised image"):
        decode_image(data, MediaPolicy())


@pytest.mark.parametrize(("data", "name"), [(GIF, "GIF"), (BMP, "BMP"), (TIFF, "TIFF"), (SVG, "SVG")])
async def test_unsupported_formats_are_422(make_fetcher: Callable[..., MediaFetcher], data: bytes, name: str) -> None:
    with pytest.raises(UnsupportedMedia, match=f"{name} images are not supported; allowed formats: JPEG, PNG, WEBP"):
        await load_image(data_url(data, "image/png"), make_fetcher())
    assert UnsupportedMedia.http_status == 422


def test_gif_decodes_when_the_policy_allows_it() -> None:
    img = decode_image(GIF, MediaPolicy(allowed_formats=frozenset({"PNG", "GIF"})))
    assert img.mode == "RGB" and img.size == SIZE


@pytest.mark.parametrize(
    ("data", "cut"), [(JPEG, 3), (JPEG, 300), (PNG, 60), (WEBP, 40), (encode("JPEG", (256, 256)), 600)]
)
def test_truncated_images_are_invalid(data: bytes, cut: int) -> None:
    with pytest.raises(InvalidMedia, match="corrupt or truncated"):
        decode_image(data[: min(cut, len(data) - 10)], MediaPolicy())


def test_corrupt_image_data_is_invalid() -> None:
    # Intact headers, garbage compressed data.
    bad_png = PNG[:33] + png_chunk(b"IDAT", b"garbage-not-zlib") + png_chunk(b"IEND", b"")
    with pytest.raises(InvalidMedia, match="corrupt"):
        decode_image(bad_png, MediaPolicy())


@pytest.mark.parametrize(
    ("width", "height"), [(30_000, 30_000), (100_000, 100_000), (2**31 - 1, 2**31 - 1), (40_001, 1000)]
)
def test_png_decompression_bomb_is_refused_from_the_header(width: int, height: int) -> None:
    bomb = png_bomb(width, height)
    assert len(bomb) < 200
    started = time.perf_counter()
    with pytest.raises(TooLarge, match="pixel limit") as info:
        decode_image(bomb, MediaPolicy())
    assert time.perf_counter() - started < 0.5
    assert info.value.http_status == 413


def test_webp_canvas_bomb_is_refused_from_the_header() -> None:
    with pytest.raises(TooLarge, match="16384x16384"):
        decode_image(webp_bomb(16384, 16384), MediaPolicy())


def test_pixel_cap_follows_the_policy() -> None:
    image = encode("PNG", (100, 100))
    with pytest.raises(TooLarge, match="100x100 = 10000 pixels, over the 5000 pixel limit"):
        decode_image(image, MediaPolicy(max_pixels=5000))
    assert decode_image(image, MediaPolicy(max_pixels=10_000)).size == (100, 100)
    with pytest.raises(TooLarge):
        decode_image(encode("JPEG", (100, 100)), MediaPolicy(max_pixels=9999))
    with pytest.raises(TooLarge):
        decode_image(encode("WEBP", (100, 100)), MediaPolicy(max_pixels=9999))


def test_pixel_cap_never_exceeds_pillows_own_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    # Above Image.MAX_IMAGE_PIXELS Pillow would warn by itself; the cap stops short of it.
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    with pytest.raises(TooLarge, match="1000 pixel limit"):
        decode_image(encode("PNG", (40, 40)), MediaPolicy(max_pixels=10**9))


@pytest.mark.parametrize(
    ("mode", "color", "fmt", "expected"),
    [
        ("RGBA", (200, 30, 30, 255), "PNG", RED),
        ("RGBA", (0, 0, 0, 0), "PNG", (255, 255, 255)),  # transparent -> white, not black
        ("LA", (100, 255), "PNG", (100, 100, 100)),
        ("L", 77, "PNG", (77, 77, 77)),
        ("1", 1, "PNG", (255, 255, 255)),
        ("I;16", 40_000, "PNG", (156, 156, 156)),
        ("CMYK", (0, 255, 255, 0), "JPEG", (255, 0, 0)),
        ("RGBA", (0, 0, 0, 0), "WEBP", (255, 255, 255)),
    ],
)
def test_modes_become_rgb(mode: str, color: Any, fmt: str, expected: tuple[int, int, int]) -> None:
    img = decode_image(encode(fmt, (8, 8), mode, color, **({"lossless": True} if fmt == "WEBP" else {})), MediaPolicy())
    assert img.mode == "RGB"
    pixel = img.getpixel((4, 4))
    assert isinstance(pixel, tuple)
    assert all(abs(a - b) <= 6 for a, b in zip(pixel, expected, strict=True)), pixel


def test_palette_with_transparency_becomes_rgb_without_warnings() -> None:
    pal = Image.new("P", (8, 8), 0)
    pal.putpalette([200, 30, 30, 0, 0, 255])
    pal.putpixel((0, 0), 1)
    buf = io.BytesIO()
    pal.save(buf, "PNG", transparency=bytes([255, 0]))
    img = decode_image(buf.getvalue(), MediaPolicy())
    assert img.mode == "RGB"
    assert img.getpixel((0, 0)) == (255, 255, 255)  # index 1 is fully transparent
    assert img.getpixel((4, 4)) == RED


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_matches_pillows_exif_transpose(fmt: str, orientation: int) -> None:
    src = Image.new("RGB", (20, 10), (0, 0, 255))
    src.paste((255, 0, 0), (0, 0, 10, 5))  # one quadrant red, so every transform is distinguishable
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    src.save(buf, fmt, exif=exif.tobytes(), **({"lossless": True} if fmt == "WEBP" else {"quality": 95}))
    img = decode_image(buf.getvalue(), MediaPolicy())
    reference = ImageOps.exif_transpose(Image.open(io.BytesIO(buf.getvalue()))).convert("RGB")
    assert img.size == reference.size == ((20, 10) if orientation <= 4 else (10, 20))
    for xy in [(1, 1), (img.width - 2, 1), (1, img.height - 2), (img.width - 2, img.height - 2)]:
        got, want = img.getpixel(xy), reference.getpixel(xy)
        assert isinstance(got, tuple) and isinstance(want, tuple)
        assert all(abs(a - b) <= 16 for a, b in zip(got, want, strict=True)), (orientation, xy, got, want)


@pytest.mark.parametrize(
    "exif", [b"Exif\x00\x00II*\x00\xff\xff\xff\xff", b"Exif\x00\x00MM\x00*\x00\x00\x00\x08\xff\xff", b"junk"]
)
@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
def test_corrupt_exif_is_ignored_without_warnings(fmt: str, exif: bytes) -> None:
    # Pillow itself warns on these (an error under -W error); decoding must not.
    buf = io.BytesIO()
    Image.new("RGB", SIZE, RED).save(buf, fmt, exif=exif, **({"lossless": True} if fmt == "WEBP" else {"quality": 95}))
    assert_red_rgb(decode_image(buf.getvalue(), MediaPolicy()))


def test_malformed_mpo_jpeg_decodes_as_its_first_picture() -> None:
    # An APP2 "MPF" segment that is garbage makes Pillow warn "malformed MPO file".
    app2 = b"MPF\x00" + b"II*\x00\x08\x00\x00\x00" + b"\xff" * 16
    data = JPEG[:2] + b"\xff\xe2" + struct.pack(">H", len(app2) + 2) + app2 + JPEG[2:]
    assert_red_rgb(decode_image(data, MediaPolicy()))


# -- http(s) ------------------------------------------------------------------------------------


async def test_fetch_over_http_with_allow_internal(
    server: ImageServer, make_fetcher: Callable[..., MediaFetcher]
) -> None:
    fetcher = make_fetcher(INTERNAL)
    assert await fetcher.fetch(server.url("/img.png")) == PNG
    for path in ("/img.png", "/img.jpg", "/img.webp"):
        assert_red_rgb(await load_image(server.url(path), fetcher))
    with pytest.raises(UnsupportedMedia):
        await load_image(server.url("/img.gif"), fetcher)
    with pytest.raises(InvalidMedia):
        await load_image(server.url("/text"), fetcher)


async def test_loopback_is_refused_without_allow_internal(
    server: ImageServer, make_fetcher: Callable[..., MediaFetcher]
) -> None:
    fetcher = make_fetcher(MediaPolicy())
    with pytest.raises(UrlNotAllowed, match="plain http: is refused"):
        await fetcher.fetch(server.url("/img.png"))
    with pytest.raises(UrlNotAllowed, match="loopback"):
        await fetcher.fetch(server.url("/img.png", scheme="https"))
    with pytest.raises(UrlNotAllowed, match="loopback"):
        await load_image(server.url("/img.png", host="[::ffff:127.0.0.1]", scheme="https"), fetcher)
    assert sum(server.hits.values()) == 0
    # Same server, same URL: allowed once the policy allows internal addresses.
    assert await make_fetcher(INTERNAL).fetch(server.url("/img.png")) == PNG
    assert server.hits["/img.png"] == 1


async def test_hostnames_are_checked_on_the_resolved_address(
    server: ImageServer, make_fetcher: Callable[..., MediaFetcher]
) -> None:
    # The real system resolver: "localhost" is loopback, refused at connect time.
    with pytest.raises(UrlNotAllowed, match=r"'localhost' resolves to .*loopback"):
        await make_fetcher(MediaPolicy()).fetch(server.url("/img.png", host="localhost", scheme="https"))

    names = {"img.test": ["127.0.0.1"]}
    blocked = FakeResolver(names)
    with pytest.raises(UrlNotAllowed, match=r"'img\.test' resolves to 127\.0\.0\.1, which is a loopback address"):
        await make_fetcher(MediaPolicy(), resolver=blocked).fetch(
            server.url("/img.png", host="img.test", scheme="https")
        )
    assert blocked.calls == ["img.test"]
    assert sum(server.hits.values()) == 0

    allowed = FakeResolver(names)
    fetcher = make_fetcher(INTERNAL, resolver=allowed)
    assert await fetcher.fetch(server.url("/img.png", host="img.test")) == PNG
    assert server.hits["/img.png"] == 1


async def test_unknown_host_fails_to_fetch(server: ImageServer, make_fetcher: Callable[..., MediaFetcher]) -> None:
    fetcher = make_fetcher(INTERNAL, resolver=FakeResolver({}))
    with pytest.raises(MediaFetchFailed, match="cannot resolve host"):
        await fetcher.fetch(server.url("/img.png", host="nowhere.test"))


async def test_redirects_are_followed_up_to_the_limit(
    server: ImageServer, make_fetcher: Callable[..., MediaFetcher]
) -> None:
    fetcher = make_fetcher(INTERNAL)
    assert await fetcher.fetch(server.url("/redirect/3")) == PNG
    assert sum(server.hits.values()) == 4
    server.hits.clear()
    with pytest.raises(MediaFetchFailed, match="more than 3 redirects"):
        await fetcher.fetch(server.url("/redirect/4"))
    assert server.hits["/redirect/0"] == 0
    assert sum(server.hits.values()) == 4
    strict = make_fetcher(MediaPolicy(allow_internal=True, max_redirects=0))
    with pytest.raises(MediaFetchFailed, match="more than 0 redirects"):
        await strict.fetch(server.url("/redirect/1"))


async def test_every_redirect_is_checked_against_the_policy(
    server: ImageServer, make_fetcher: Callable[..., MediaFetcher]
) -> None:
    """A redirect from an allowed host to a denied one is refused before connecting to it."""
    try:
        second = await ImageServer("127.0.0.2").start()
    except OSError:
        pytest.skip("cannot bind 127.0.0.2")
    try:
        names = {"second.test": ["127.0.0.2"]}
        via_literal = server.url("/to") + "?url=" + second.url("/img.png")
        via_name = server.url("/to") + "?url=" + second.url("/img.png", host="second.test")

        # Control: nothing denied, the redirect lands on the second server.
        open_fetcher = make_fetcher(INTERNAL, resolver=FakeResolver(names), cache_max_items=0)
        assert await open_fetcher.fetch(via_literal) == PNG
        assert await open_fetcher.fetch(via_name) == PNG
        assert second.hits["/img.png"] == 2

        denied = MediaPolicy(allow_internal=True, denied_networks=("127.0.0.2/32",))
        fetcher = make_fetcher(denied, resolver=FakeResolver(names))
        with pytest.raises(UrlNotAllowed, match=r"127\.0\.0\.2 is in denied network"):
            await fetcher.fetch(via_literal)
        with pytest.raises(UrlNotAllowed, match=r"'second.test' resolves to 127\.0\.0\.2, which is in denied network"):
            await fetcher.fetch(via_name)
        assert second.hits["/img.png"] == 2
        assert server.hits["/to"] == 4
    finally:
        await second.close()


async def test_redirects_to_other_schemes_are_refused(
    server: ImageServer, make_fetcher: Callable[..., MediaFetcher], tmp_path: Path
) -> None:
    (tmp_path / "img.png").write_bytes(PNG)
    fetcher = make_fetcher(MediaPolicy(allow_internal=True, allowed_local_dirs=(str(tmp_path),)))
    for target in (f"file://{tmp_path}/img.png", data_url(PNG)[:60], "ftp://127.0.0.1/img.png"):
        with pytest.raises(UrlNotAllowed, match="redirect to scheme"):
            await fetcher.fetch(server.url("/to") + "?url=" + target)


async def test_http_errors_fail_with_the_status(server: ImageServer, make_fetcher: Callable[..., MediaFetcher]) -> None:
    with pytest.raises(MediaFetchFailed, match="HTTP 404 Not Found") as info:
        await make_fetcher(INTERNAL).fetch(server.url("/missing.png"))
    assert info.value.http_status == 400 and not info.value.retryable


async def test_fetch_timeout(server: ImageServer, make_fetcher: Callable[..., MediaFetcher]) -> None:
    fetcher = make_fetcher(MediaPolicy(allow_internal=True, fetch_timeout_s=0.3))
    started = time.perf_counter()
    with pytest.raises(MediaFetchFailed, match=r"timed out after 0\.3s"):
        await fetcher.fetch(server.url("/slow"))
    assert time.perf_counter() - started < 2.0


@pytest.mark.parametrize("path", ["/huge", "/huge-cl", "/gzip-bomb"])
async def test_byte_cap(server: ImageServer, make_fetcher: Callable[..., MediaFetcher], path: str) -> None:
    fetcher = make_fetcher(MediaPolicy(allow_internal=True, max_bytes=1024 * 1024))
    with pytest.raises(TooLarge, match="1048576 byte limit"):
        await fetcher.fetch(server.url(path))


@pytest.mark.parametrize("path", ["/video-sized", "/video-sized-chunked"])
async def test_per_call_byte_cap_over_http(
    server: ImageServer, make_fetcher: Callable[..., MediaFetcher], path: str
) -> None:
    fetcher = make_fetcher(INTERNAL)
    url = server.url(path)
    with pytest.raises(TooLarge, match=f"over the {INTERNAL.max_bytes} byte limit"):
        await fetcher.fetch(url)
    assert await fetcher.fetch(url, max_bytes=INTERNAL.video_max_bytes) == payload(VIDEO_SIZED)
    assert server.hits[path] == 2
    # Now in the LRU (30 MiB of its 128): a hit is still held to each caller's own cap.
    with pytest.raises(TooLarge, match=f"is {VIDEO_SIZED} bytes, over the {INTERNAL.max_bytes} byte limit"):
        await fetcher.fetch(url)
    assert await fetcher.fetch(url, max_bytes=INTERNAL.video_max_bytes) == payload(VIDEO_SIZED)
    assert server.hits[path] == 2


async def test_the_lru_keeps_nothing_over_its_capacity_whatever_the_cap(
    server: ImageServer, make_fetcher: Callable[..., MediaFetcher]
) -> None:
    fetcher = make_fetcher(INTERNAL, cache_max_bytes=VIDEO_SIZED - 1)
    for _ in range(2):
        assert await fetcher.fetch(server.url("/video-sized"), max_bytes=INTERNAL.video_max_bytes) == payload(
            VIDEO_SIZED
        )
    assert server.hits["/video-sized"] == 2


async def test_a_smaller_cap_joins_a_larger_download(
    server: ImageServer, make_fetcher: Callable[..., MediaFetcher]
) -> None:
    fetcher = make_fetcher(INTERNAL)
    url = server.url("/gated-big")
    big = asyncio.create_task(fetcher.fetch(url, max_bytes=4 * MiB))
    await wait_until(lambda: server.hits["/gated-big"] == 1)
    small = asyncio.create_task(fetcher.fetch(url, max_bytes=1 * MiB))
    await asyncio.sleep(0.05)
    server.release.set()
    assert await big == payload(GATED_BIG)
    with pytest.raises(TooLarge, match=f"is {GATED_BIG} bytes, over the {MiB} byte limit"):
        await small
    assert server.hits["/gated-big"] == 1


async def test_a_larger_cap_does_not_join_a_smaller_download(
    server: ImageServer, make_fetcher: Callable[..., MediaFetcher]
) -> None:
    """The download in flight would stop at the smaller cap; the larger caller starts its own."""
    fetcher = make_fetcher(INTERNAL)
    url = server.url("/gated-big")
    small = asyncio.create_task(fetcher.fetch(url, max_bytes=1 * MiB))
    await wait_until(lambda: server.hits["/gated-big"] == 1)
    big = asyncio.create_task(fetcher.fetch(url, max_bytes=4 * MiB))
    await wait_until(lambda: server.hits["/gated-big"] == 2)
    # Later callers join the larger download, whatever their cap.
    later = asyncio.create_task(fetcher.fetch(url, max_bytes=4 * MiB))
    await asyncio.sleep(0.05)
    server.release.set()
    with pytest.raises(TooLarge, match=f"is {GATED_BIG} bytes, over the {MiB} byte limit"):
        await small
    assert await big == await later == payload(GATED_BIG)
    assert server.hits["/gated-big"] == 2


async def test_a_shared_download_over_every_cap_names_each_callers_own(
    server: ImageServer, make_fetcher: Callable[..., MediaFetcher]
) -> None:
    fetcher = make_fetcher(INTERNAL)
    url = server.url("/gated-big")
    larger = asyncio.create_task(fetcher.fetch(url, max_bytes=2 * MiB))
    await wait_until(lambda: server.hits["/gated-big"] == 1)
    smaller = asyncio.create_task(fetcher.fetch(url, max_bytes=1 * MiB))
    await asyncio.sleep(0.05)
    server.release.set()
    with pytest.raises(TooLarge, match=f"over the {2 * MiB} byte limit"):
        await larger
    with pytest.raises(TooLarge, match=f"over the {MiB} byte limit"):
        await smaller
    assert server.hits["/gated-big"] == 1


async def test_cancelling_the_caller_that_started_a_download_leaves_it_to_the_others(
    server: ImageServer, make_fetcher: Callable[..., MediaFetcher]
) -> None:
    fetcher = make_fetcher(INTERNAL)
    url = server.url("/gated-big")
    starter = asyncio.create_task(fetcher.fetch(url, max_bytes=8 * MiB))
    await wait_until(lambda: server.hits["/gated-big"] == 1)
    joiner = asyncio.create_task(fetcher.fetch(url, max_bytes=4 * MiB))
    await asyncio.sleep(0.05)
    starter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starter
    server.release.set()
    assert await joiner == payload(GATED_BIG)
    assert server.hits["/gated-big"] == 1


async def test_concurrent_fetches_share_one_download(
    server: ImageServer, make_fetcher: Callable[..., MediaFetcher]
) -> None:
    fetcher = make_fetcher(INTERNAL)
    url = server.url("/gated")
    tasks = [asyncio.create_task(load_image(url, fetcher)) for _ in range(8)]
    await wait_until(lambda: server.hits["/gated"] == 1)
    await asyncio.sleep(0.05)
    server.release.set()
    for img in await asyncio.gather(*tasks):
        assert_red_rgb(img)
    assert server.hits["/gated"] == 1
    # Then served from the cache.
    assert await fetcher.fetch(url) == PNG
    assert server.hits["/gated"] == 1


async def test_a_cancelled_caller_does_not_cancel_the_shared_download(
    server: ImageServer, make_fetcher: Callable[..., MediaFetcher]
) -> None:
    fetcher = make_fetcher(INTERNAL)
    url = server.url("/gated")
    first = asyncio.create_task(fetcher.fetch(url))
    second = asyncio.create_task(fetcher.fetch(url))
    await wait_until(lambda: server.hits["/gated"] == 1)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    server.release.set()
    assert await second == PNG
    assert server.hits["/gated"] == 1


async def test_download_is_dropped_when_every_caller_leaves(
    server: ImageServer, make_fetcher: Callable[..., MediaFetcher]
) -> None:
    fetcher = make_fetcher(INTERNAL)
    url = server.url("/gated")
    only = asyncio.create_task(fetcher.fetch(url))
    await wait_until(lambda: server.hits["/gated"] == 1)
    only.cancel()
    with pytest.raises(asyncio.CancelledError):
        await only
    # A new caller starts a new download rather than joining the abandoned one.
    server.release.set()
    assert await asyncio.wait_for(fetcher.fetch(url), 5) == PNG
    assert server.hits["/gated"] == 2


async def test_close_aborts_in_flight_fetches(server: ImageServer, make_fetcher: Callable[..., MediaFetcher]) -> None:
    fetcher = make_fetcher(INTERNAL)
    pending = asyncio.create_task(fetcher.fetch(server.url("/gated")))
    await wait_until(lambda: server.hits["/gated"] == 1)
    await fetcher.close()
    with pytest.raises(MediaFetchFailed, match="aborted"):
        await pending
    with pytest.raises(RuntimeError, match="closed"):
        await fetcher.fetch(server.url("/img.png"))
    await fetcher.close()  # idempotent


async def test_cache_is_bounded(server: ImageServer, make_fetcher: Callable[..., MediaFetcher]) -> None:
    one = make_fetcher(INTERNAL, cache_max_items=1)
    for path in ("/img.png", "/img.png", "/img.jpg", "/img.png"):
        await one.fetch(server.url(path))
    assert server.hits["/img.png"] == 2 and server.hits["/img.jpg"] == 1

    server.hits.clear()
    small = make_fetcher(INTERNAL, cache_max_bytes=len(PNG) - 1)
    for _ in range(2):
        await small.fetch(server.url("/img.png"))
    assert server.hits["/img.png"] == 2

    server.hits.clear()
    stale = make_fetcher(INTERNAL, cache_ttl_s=0.0)
    for _ in range(2):
        await stale.fetch(server.url("/img.png"))
    assert server.hits["/img.png"] == 2


@pytest.mark.parametrize(
    "url", ["ftp://example.com/a.png", "javascript:alert(1)", "gopher://x/", "img.png", "", "//example.com/a.png"]
)
async def test_other_schemes_are_refused(make_fetcher: Callable[..., MediaFetcher], url: str) -> None:
    with pytest.raises(UrlNotAllowed, match="use https: or data:"):
        await make_fetcher(INTERNAL).fetch(url)


# -- file: ---------------------------------------------------------------------------------------


@pytest.fixture
def media_dirs(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    allowed = tmp_path / "allowed"
    outside = tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "img.png").write_bytes(PNG)
    (allowed / "sub").mkdir()
    (allowed / "sub" / "img.jpg").write_bytes(JPEG)
    (outside / "secret.png").write_bytes(PNG)
    yield allowed, outside


async def test_file_urls_under_an_allowed_dir(
    make_fetcher: Callable[..., MediaFetcher], media_dirs: tuple[Path, Path]
) -> None:
    allowed, _ = media_dirs
    fetcher = make_fetcher(MediaPolicy(allowed_local_dirs=(allowed,)))
    assert await fetcher.fetch(f"file://{allowed}/img.png") == PNG
    assert await fetcher.fetch(f"file://localhost{allowed}/img.png") == PNG
    assert_red_rgb(await load_image(f"file://{allowed}/sub/img.jpg", fetcher))
    assert await fetcher.fetch(f"file://{allowed}/sub/../img.png") == PNG
    (allowed / "link.png").symlink_to(allowed / "sub" / "img.jpg")
    assert await fetcher.fetch(f"file://{allowed}/link.png") == JPEG


async def test_file_urls_outside_allowed_dirs_are_refused(
    make_fetcher: Callable[..., MediaFetcher], media_dirs: tuple[Path, Path]
) -> None:
    allowed, outside = media_dirs
    (allowed / "escape.png").symlink_to(outside / "secret.png")
    (allowed / "escape-dir").symlink_to(outside, target_is_directory=True)
    fetcher = make_fetcher(MediaPolicy(allowed_local_dirs=(str(allowed),)))
    refused = [
        f"file://{outside}/secret.png",
        f"file://{allowed}/../outside/secret.png",
        f"file://{allowed}/%2e%2e/outside/secret.png",
        f"file://{allowed}/sub/..%2F..%2Foutside%2Fsecret.png",
        f"file://{allowed}/escape.png",
        f"file://{allowed}/escape-dir/secret.png",
        f"file://{allowed}_sibling/img.png",  # a prefix match is not containment
        "file:///etc/passwd",
        f"file://evil.example{allowed}/img.png",
        "file:img.png",
    ]
    for url in refused:
        with pytest.raises(UrlNotAllowed):
            await fetcher.fetch(url)
    with pytest.raises(UrlNotAllowed, match="file: URLs are disabled"):
        await make_fetcher(MediaPolicy()).fetch(f"file://{allowed}/img.png")


async def test_file_url_per_call_byte_cap(make_fetcher: Callable[..., MediaFetcher], tmp_path: Path) -> None:
    (tmp_path / "v.mp4").write_bytes(payload(VIDEO_SIZED))
    fetcher = make_fetcher(MediaPolicy(allowed_local_dirs=(tmp_path,)))
    url = f"file://{tmp_path}/v.mp4"
    with pytest.raises(TooLarge, match=f"is {VIDEO_SIZED} bytes, over the {20 * MiB} byte limit"):
        await fetcher.fetch(url)
    assert await fetcher.fetch(url, max_bytes=MediaPolicy().video_max_bytes) == payload(VIDEO_SIZED)
    with pytest.raises(TooLarge, match=f"over the {VIDEO_SIZED - 1} byte limit"):
        await fetcher.fetch(url, max_bytes=VIDEO_SIZED - 1)


async def test_file_url_failures(make_fetcher: Callable[..., MediaFetcher], media_dirs: tuple[Path, Path]) -> None:
    allowed, _ = media_dirs
    fetcher = make_fetcher(MediaPolicy(allowed_local_dirs=(allowed,), max_bytes=len(PNG)))
    with pytest.raises(MediaFetchFailed, match="not found"):
        await fetcher.fetch(f"file://{allowed}/missing.png")
    with pytest.raises(MediaFetchFailed, match="not a regular file"):
        await fetcher.fetch(f"file://{allowed}/sub")
    os.mkfifo(allowed / "fifo")
    with pytest.raises(MediaFetchFailed, match="not a regular file"):
        await asyncio.wait_for(fetcher.fetch(f"file://{allowed}/fifo"), 5)
    (allowed / "big.png").write_bytes(PNG + b"\x00")
    with pytest.raises(TooLarge):
        await fetcher.fetch(f"file://{allowed}/big.png")
