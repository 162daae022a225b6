"""Turning fetched bytes into an RGB PIL image, safely.

The format comes from the bytes, never from a declared MIME type, and the pixel count is
read from the header and checked before Pillow allocates or decodes anything.

Pillow reports some problems as warnings (decompression bombs, corrupt EXIF, palette
transparency). A warning is process-global noise in production and an exception under
``-W error``, and ``warnings.catch_warnings`` is not thread-safe (decoding runs in
threads), so this module avoids the code paths that warn instead of catching them:
it enforces a pixel cap no higher than ``Image.MAX_IMAGE_PIXELS`` itself, reads the EXIF
orientation itself (rather than ``ImageOps.exif_transpose``, whose EXIF parser warns on
corrupt data) and strips the JPEG segments Pillow would parse on open, and converts
transparent palettes through RGBA.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
from typing import TYPE_CHECKING, Literal

from PIL import Image

from schemas.errors import InvalidMedia, TooLarge, UnsupportedMedia
from stages.media.policy import MediaPolicy

if TYPE_CHECKING:
    from stages.media.fetch import MediaFetcher

# Formats recognised only to be refused with a useful message.
_FOREIGN_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"II+\x00", "TIFF"),
    (b"MM\x00+", "TIFF"),
    (b"\x00\x00\x01\x00", "ICO"),
    (b"\x00\x00\x02\x00", "CUR"),
    (b"\x00\x00\x00\x0cjP  \r\n\x87\n", "JPEG 2000"),
    (b"\xff\x4f\xff\x51", "JPEG 2000"),
    (b"\xff\x0a", "JPEG XL"),
    (b"\x00\x00\x00\x0cJXL \r\n\x87\n", "JPEG XL"),
    (b"8BPS", "PSD"),
    (b"icns", "ICNS"),
    (b"qoif", "QOI"),
    (b"%PDF-", "PDF"),
)
_HEIF_BRANDS = frozenset({b"heic", b"heix", b"hevc", b"hevx", b"heim", b"heis", b"mif1", b"msf1"})
_AVIF_BRANDS = frozenset({b"avif", b"avis"})
_BMP_HEADER_SIZES = frozenset({12, 16, 40, 52, 56, 64, 108, 124})

# JPEG start-of-frame markers: C0-CF except DHT (C4), JPG (C8) and DAC (CC).
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}

# EXIF orientation -> the transpose that undoes it (as ImageOps.exif_transpose).
_ORIENTATION = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


def sniff_format(data: bytes) -> str | None:
    """The image format ``data`` is, from its magic bytes; None when it is not a known image."""
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    for magic, name in _FOREIGN_MAGIC:
        if data.startswith(magic):
            return name
    if data[:2] == b"BM" and len(data) >= 18 and int.from_bytes(data[14:18], "little") in _BMP_HEADER_SIZES:
        return "BMP"
    if data[4:8] == b"ftyp":
        brand = data[8:12]
        if brand in _AVIF_BRANDS:
            return "AVIF"
        if brand in _HEIF_BRANDS:
            return "HEIF"
    head = data[:1024].lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    if head.startswith(b"<") and b"<svg" in head:
        return "SVG"
    return None


_Order = Literal["little", "big"]


def _u16(b: bytes, i: int, order: _Order = "big") -> int:
    return int.from_bytes(b[i : i + 2], order)


def _u32(b: bytes, i: int, order: _Order = "big") -> int:
    return int.from_bytes(b[i : i + 4], order)


@dataclasses.dataclass(frozen=True, slots=True)
class _JpegHeader:
    size: tuple[int, int]
    exif: bytes | None
    # The bytes to hand Pillow: the input less the segments it would parse and warn about.
    data: bytes


# APP1 EXIF (Pillow parses it on open to find the DPI) and APP2 MPF (multi-picture index):
# corrupt ones make Pillow warn. We read orientation ourselves and want only the first picture.
_JPEG_STRIP = ((0xE1, b"Exif\x00\x00"), (0xE2, b"MPF\x00"))


def _jpeg_header(data: bytes) -> _JpegHeader:
    """Walk the JPEG segments up to the scan data: frame size, EXIF, and what to strip."""
    i, n = 2, len(data)
    size: tuple[int, int] | None = None
    exif: bytes | None = None
    strip: list[tuple[int, int]] = []
    while True:
        if i >= n:
            raise InvalidMedia("corrupt or truncated JPEG: ends before the image data")
        if data[i] != 0xFF:
            raise InvalidMedia("corrupt JPEG: bad segment marker")
        start = i
        while i < n and data[i] == 0xFF:  # fill bytes
            i += 1
        if i >= n:
            continue
        marker = data[i]
        i += 1
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            continue
        if marker == 0xD9:
            raise InvalidMedia("corrupt JPEG: end of image before any image data")
        if i + 2 > n:
            raise InvalidMedia("corrupt or truncated JPEG: ends before the image data")
        length = _u16(data, i)
        if length < 2 or i + length > n:
            raise InvalidMedia("corrupt or truncated JPEG: bad segment length")
        body = data[i + 2 : i + length]
        if marker == 0xDA:  # start of scan: the header is over
            break
        if marker in _JPEG_SOF and size is None:
            if len(body) < 5:
                raise InvalidMedia("corrupt JPEG: short frame header")
            size = (_u16(body, 3), _u16(body, 1))
        for strip_marker, prefix in _JPEG_STRIP:
            if marker == strip_marker and body.startswith(prefix):
                if marker == 0xE1 and exif is None:
                    exif = body
                strip.append((start, i + length))
        i += length
    if size is None:
        raise InvalidMedia("corrupt JPEG: no frame header before the image data")
    if strip:
        parts, last = [], 0
        for begin, stop in strip:
            parts.append(data[last:begin])
            last = stop
        parts.append(data[last:])
        data = b"".join(parts)
    return _JpegHeader(size, exif, data)


def _webp_size(data: bytes) -> tuple[int, int]:
    chunk = data[12:16]
    if chunk == b"VP8 " and len(data) >= 30 and data[23:26] == b"\x9d\x01\x2a":
        return _u16(data, 26, "little") & 0x3FFF, _u16(data, 28, "little") & 0x3FFF
    if chunk == b"VP8L" and len(data) >= 25 and data[20] == 0x2F:
        bits = _u32(data, 21, "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8X" and len(data) >= 30:
        return int.from_bytes(data[24:27], "little") + 1, int.from_bytes(data[27:30], "little") + 1
    raise InvalidMedia("corrupt or truncated WebP: no readable frame header")


def header_size(fmt: str, data: bytes) -> tuple[int, int]:
    """(width, height) from the header of a sniffed image, without decoding it."""
    if fmt == "PNG":
        if len(data) < 24 or data[12:16] != b"IHDR":
            raise InvalidMedia("corrupt or truncated PNG: no IHDR header")
        return _u32(data, 16), _u32(data, 20)
    if fmt == "JPEG":
        return _jpeg_header(data).size
    if fmt == "WEBP":
        return _webp_size(data)
    if fmt == "GIF":
        if len(data) < 10:
            raise InvalidMedia("corrupt or truncated GIF header")
        return _u16(data, 6, "little"), _u16(data, 8, "little")
    raise UnsupportedMedia(f"{fmt} images are not supported")


def _pixel_limit(policy: MediaPolicy) -> int:
    # Never above Pillow's own bomb threshold: past it Pillow warns (or raises) by itself.
    pil_limit = Image.MAX_IMAGE_PIXELS
    return policy.max_pixels if pil_limit is None else min(policy.max_pixels, int(pil_limit))


def _check_pixels(size: tuple[int, int], policy: MediaPolicy) -> None:
    width, height = size
    if width <= 0 or height <= 0:
        raise InvalidMedia(f"image has an empty size ({width}x{height})")
    limit = _pixel_limit(policy)
    if width * height > limit:
        raise TooLarge(f"image is {width}x{height} = {width * height} pixels, over the {limit} pixel limit")


def _exif_orientation(exif: bytes) -> int:
    """The EXIF orientation tag (1 when absent or unreadable), read from IFD0 only."""
    if exif.startswith(b"Exif\x00\x00"):
        exif = exif[6:]
    if len(exif) < 8 or exif[:2] not in (b"II", b"MM"):
        return 1
    order: _Order = "little" if exif[:2] == b"II" else "big"
    if _u16(exif, 2, order) != 42:
        return 1
    ifd = _u32(exif, 4, order)
    if ifd + 2 > len(exif):
        return 1
    for k in range(_u16(exif, ifd, order)):
        entry = ifd + 2 + 12 * k
        if entry + 12 > len(exif):
            break
        if _u16(exif, entry, order) == 0x0112:
            value = _u16(exif, entry + 8, order) if _u16(exif, entry + 2, order) == 3 else 1
            return value if value in _ORIENTATION else 1
    return 1


def _to_rgb(img: Image.Image) -> Image.Image:
    mode = img.mode
    if mode == "RGB":
        return img
    if mode in ("RGBA", "RGBa", "LA", "La", "PA") or "transparency" in img.info:
        # Transparent areas become white, not whatever colour hides under alpha 0 (often black).
        rgba = img.convert("RGBA")
        out = Image.new("RGB", rgba.size, (255, 255, 255))
        out.paste(rgba, mask=rgba.getchannel("A"))
        return out
    if mode == "I" or mode.startswith("I;16"):
        # 16-bit samples: scale to 8 bits; a plain convert clips nearly everything to white.
        img = img.convert("I").point(lambda v: v * (1 / 256)).convert("L")
    return img.convert("RGB")


def decode_image(data: bytes, policy: MediaPolicy) -> Image.Image:
    """Decode ``data`` to a loaded RGB image, EXIF orientation applied.

    UnsupportedMedia for a known image format the policy does not allow, InvalidMedia for
    bytes that are not an image or are corrupt, TooLarge over the policy's pixel cap.
    """
    fmt = sniff_format(data)
    if fmt is None:
        raise InvalidMedia(f"media is not a recognised image (starts with {data[:8].hex() or 'nothing'})")
    if fmt not in policy.allowed_formats:
        raise UnsupportedMedia(f"{fmt} images are not supported; allowed formats: {policy.formats_text()}")
    exif: bytes | None = None
    if fmt == "JPEG":
        jpeg = _jpeg_header(data)
        size, exif, data = jpeg.size, jpeg.exif, jpeg.data
    else:
        size = header_size(fmt, data)
    _check_pixels(size, policy)
    try:
        img = Image.open(io.BytesIO(data), formats=[fmt])
        # The header parser above and Pillow could disagree on odd files; trust neither alone.
        _check_pixels(img.size, policy)
        img.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise TooLarge(f"image is over the pixel limit: {e}") from None
    except (TooLarge, InvalidMedia):
        raise
    except MemoryError:
        raise
    except Exception as e:  # Pillow reports corrupt input through many exception types
        raise InvalidMedia(f"corrupt or truncated {fmt} image: {e}") from None
    if exif is None:
        raw = img.info.get("exif")
        exif = raw if isinstance(raw, bytes) else None
    method = _ORIENTATION.get(_exif_orientation(exif)) if exif is not None else None
    try:
        out = _to_rgb(img)
    except Exception as e:  # an unconvertible mode is a bad image, not a server fault
        raise InvalidMedia(f"cannot convert {fmt} image in mode {img.mode} to RGB: {e}") from None
    return out.transpose(method) if method is not None else out


async def load_image(url: str, fetcher: MediaFetcher, policy: MediaPolicy | None = None) -> Image.Image:
    """Fetch ``url`` with ``fetcher`` and decode it (in a thread) under ``policy``.

    ``policy`` defaults to the fetcher's; the fetch itself always runs under the fetcher's.
    """
    data = await fetcher.fetch(url)
    return await asyncio.to_thread(decode_image, data, policy if policy is not None else fetcher.policy)
