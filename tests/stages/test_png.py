"""stages/image_engine/png.py: PNG files from uint8 arrays decode to exactly
their pixels, whether deflated whole or in parts on a pool; the IDAT is one
real zlib stream (its adler32 checked, which Pillow's decoder may never
reach); every chunk's CRC holds."""

from __future__ import annotations

import io
import struct
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
from PIL import Image

from stages.image_engine.engine import png
from stages.image_engine.png import SIGNATURE, encode_png

MODES = {1: "L", 3: "RGB", 4: "RGBA"}


@pytest.fixture(scope="module")
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(3, thread_name_prefix="png-test") as executor:
        yield executor


def _noise(height: int, width: int, channels: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)


def _gradient(height: int, width: int, channels: int) -> np.ndarray:
    y, x = np.mgrid[0:height, 0:width]
    planes = [x * 3 + y, y * 5, x + y * 2, 255 - x][:channels]
    return (np.stack(planes, axis=-1) % 256).astype(np.uint8)


def _decoders() -> list[tuple[str, Any]]:
    """Pillow, and an independent decoder where one is installed."""

    def pillow(data: bytes) -> np.ndarray:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            return np.asarray(image)

    found: list[tuple[str, Any]] = [("pillow", pillow)]
    try:
        import cv2

        def opencv(data: bytes) -> np.ndarray:
            out = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
            if out.ndim == 3:  # BGR(A) to RGB(A)
                out = out[:, :, [2, 1, 0, 3][: out.shape[2]]]
            return np.asarray(out)

        found.append(("opencv", opencv))
    except ImportError:
        pass
    try:
        import imageio.v3 as iio

        found.append(("imageio", lambda data: np.asarray(iio.imread(data, extension=".png"))))
    except ImportError:
        pass
    return found


def _chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    """The file's chunks (type, data), each CRC checked."""
    assert data[:8] == SIGNATURE
    chunks, at = [], 8
    while at < len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        kind, body = data[at + 4 : at + 8], data[at + 8 : at + 8 + length]
        (crc,) = struct.unpack(">I", data[at + 8 + length : at + 12 + length])
        assert crc == zlib.crc32(kind + body), kind
        chunks.append((kind, body))
        at += 12 + length
    assert at == len(data)
    return chunks


SHAPES = [(1, 1), (7, 13), (13, 7), (64, 48), (513, 257)]


@pytest.mark.parametrize("channels", [1, 3, 4])
@pytest.mark.parametrize(("height", "width"), SHAPES)
@pytest.mark.parametrize("parts", [1, 3])
@pytest.mark.parametrize("kind", ["noise", "gradient"])
def test_a_file_decodes_to_exactly_its_pixels(
    pool: ThreadPoolExecutor, kind: str, parts: int, height: int, width: int, channels: int
) -> None:
    pixels = _noise(height, width, channels) if kind == "noise" else _gradient(height, width, channels)
    data = encode_png(pixels, parts=parts, pool=pool)
    want = pixels[:, :, 0] if channels == 1 else pixels
    with Image.open(io.BytesIO(data)) as image:
        assert (image.format, image.mode, image.size) == ("PNG", MODES[channels], (width, height))
    for name, decode in _decoders():
        got = decode(data)
        assert got.dtype == np.uint8, name
        np.testing.assert_array_equal(got, want, err_msg=name)


@pytest.mark.parametrize("level", [-1, 0, 1, 5, 6, 9])
@pytest.mark.parametrize("parts", [1, 2, 4])
def test_the_idat_is_one_zlib_stream_with_its_checksum(pool: ThreadPoolExecutor, level: int, parts: int) -> None:
    pixels = _gradient(100, 77, 3) ^ _noise(100, 77, 3, seed=level + 1) // 16
    data = encode_png(pixels, level=level, parts=parts, pool=pool)
    chunks = _chunks(data)
    assert [kind for kind, _ in chunks] == [b"IHDR", b"IDAT", b"IEND"]
    assert chunks[0][1] == struct.pack(">IIBBBBB", 77, 100, 8, 2, 0, 0, 0)
    idat = chunks[1][1]
    # zlib's own header for the level; the stream ends exactly on its adler32.
    assert idat[:2] == zlib.compress(b"", level)[:2]
    inflater = zlib.decompressobj()
    rows = inflater.decompress(idat) + inflater.flush()
    assert inflater.eof and inflater.unused_data == b""
    assert rows == zlib.decompress(idat)
    assert idat[-4:] == struct.pack(">I", zlib.adler32(rows))
    # Every row filtered "Up": undone by a running sum down the rows.
    filtered = np.frombuffer(rows, np.uint8).reshape(100, 1 + 77 * 3)
    assert (filtered[:, 0] == 2).all()
    undone = np.cumsum(filtered[:, 1:], axis=0, dtype=np.uint64) % 256
    np.testing.assert_array_equal(undone.astype(np.uint8).reshape(pixels.shape), pixels)


def test_parts_change_nothing_decoded_and_little_in_size(pool: ThreadPoolExecutor) -> None:
    pixels = _gradient(300, 200, 3)
    whole = encode_png(pixels)
    assert whole == encode_png(pixels, parts=3)  # no pool: deflated whole
    for parts in (2, 3, 8):
        cut = encode_png(pixels, parts=parts, pool=pool)
        assert zlib.decompress(_chunks(cut)[1][1]) == zlib.decompress(_chunks(whole)[1][1])
        # Each cut costs a sync flush and a fresh window, not a second copy.
        assert len(cut) < len(whole) * 1.5 + 64 * parts


def test_more_parts_than_bytes_still_make_one_stream(pool: ThreadPoolExecutor) -> None:
    pixels = _noise(1, 1, 4)  # five bytes of rows in eight parts: some parts empty
    data = encode_png(pixels, parts=8, pool=pool)
    with Image.open(io.BytesIO(data)) as image:
        np.testing.assert_array_equal(np.asarray(image), pixels)
    assert zlib.decompress(_chunks(data)[1][1]) == b"\x02" + pixels.tobytes()


def test_any_strides_and_a_2d_array(pool: ThreadPoolExecutor) -> None:
    """A permuted (channels-first) array, as a tensor's .numpy() may be, and
    a 2-D one (one channel)."""
    planar = np.ascontiguousarray(_noise(33, 21, 3).transpose(2, 0, 1))
    pixels = planar.transpose(1, 2, 0)
    assert not pixels.flags.c_contiguous
    with Image.open(io.BytesIO(encode_png(pixels, parts=2, pool=pool))) as image:
        np.testing.assert_array_equal(np.asarray(image), pixels)
    gray = _noise(9, 5, 1)[:, :, 0]
    with Image.open(io.BytesIO(encode_png(gray))) as image:
        assert image.mode == "L"
        np.testing.assert_array_equal(np.asarray(image), gray)


@pytest.mark.parametrize(
    ("pixels", "says"),
    [
        (np.zeros((4, 4, 3), np.uint16), "uint8"),
        (np.zeros((4, 4, 2), np.uint8), "C 1, 3 or 4"),
        (np.zeros((4,), np.uint8), "C 1, 3 or 4"),
        (np.zeros((0, 4, 3), np.uint8), "4x0 pixels"),
    ],
)
def test_what_is_no_image_is_refused(pixels: np.ndarray, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        encode_png(pixels)


def test_bad_levels_and_parts_are_refused() -> None:
    with pytest.raises(ValueError, match="level 10"):
        encode_png(_noise(2, 2, 3), level=10)
    with pytest.raises(ValueError, match="parts is 0"):
        encode_png(_noise(2, 2, 3), parts=0)


def _filters(data: bytes, height: int) -> set[int]:
    rows = zlib.decompress(b"".join(body for kind, body in _chunks(data) if kind == b"IDAT"))
    return set(np.frombuffer(rows, np.uint8).reshape(height, -1)[:, 0].tolist())


@pytest.mark.parametrize("mode", ["L", "RGB", "RGBA"])
def test_the_stages_png_encodes_arrays_and_plain_pil_images_itself(pool: ThreadPoolExecutor, mode: str) -> None:
    pixels = _gradient(24, 40, len(mode))
    array = pixels[:, :, 0] if mode == "L" else pixels
    image = Image.fromarray(array, mode=mode)
    for data in (png(pixels), png(image), png(pixels, parts=2, pool=pool)):
        assert _filters(data, 24) == {2}  # every row "Up": encode_png, not Pillow's choice a row
        with Image.open(io.BytesIO(data)) as got:
            assert got.mode == mode
            np.testing.assert_array_equal(np.asarray(got), array)


def test_the_stages_png_leaves_other_pil_images_to_pillow() -> None:
    """A palette image, and an RGB one with a profile Pillow would write:
    Pillow's own file, the palette and profile kept."""
    palette = Image.fromarray(_noise(10, 12, 1)[:, :, 0], mode="L").convert("P")
    profiled = Image.fromarray(_gradient(10, 12, 3), mode="RGB")
    profiled.info["icc_profile"] = b"not a real profile"
    for image in (palette, profiled):
        with Image.open(io.BytesIO(png(image))) as got:
            got.load()
            assert got.mode == image.mode
            assert got.info.get("icc_profile") == image.info.get("icc_profile")
            assert got.tobytes() == image.tobytes()
