"""What the encoder tests send: seeded random PNGs, inline in a request's media."""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image

from schemas.processed import MediaItem, MediaKind, ProcessedRequest
from schemas.request import ChatMessage, GenerateRequest


def png(seed: int, size: tuple[int, int] = (40, 30)) -> bytes:
    buf = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def image_request(*pngs: bytes) -> ProcessedRequest:
    """A one-token request whose media are ``pngs`` as data URLs."""
    urls = [f"data:image/png;base64,{base64.b64encode(p).decode()}" for p in pngs]
    media = [MediaItem(MediaKind.IMAGE, url, i) for i, url in enumerate(urls)]
    request = GenerateRequest(request_id="r", model="m", messages=[ChatMessage("user", "x")])
    return ProcessedRequest(request, [0] * len(pngs), media, ["encode"], max_tokens=1, seed=0)
