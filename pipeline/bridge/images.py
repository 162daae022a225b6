"""OpenAI's images API (``POST /v1/images/generations``) as the bridge
takes it: the request, its translation into an image-generation hop, and
the response made of the stage's image chunks."""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec
import pybase64

from schemas.chunk import ImageChunk
from schemas.errors import InvalidRequest
from schemas.request import ImageParams

_SIZE = re.compile(r"([1-9][0-9]{0,4})x([1-9][0-9]{0,4})")


class ImagesRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Unknown fields are refused (400): a quality or style the stage does
    not have should not pass unnoticed. ``seed``, ``num_inference_steps``
    and ``guidance_scale`` are extras (vLLM-Omni's and diffusers' names)."""

    prompt: str
    model: str | None = None
    n: int = 1
    size: str | None = None
    response_format: Literal["b64_json", "url"] | None = None
    output_format: Literal["png"] | None = None
    user: str | None = None
    seed: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None


IMAGES_DECODER = msgspec.json.Decoder(ImagesRequest)


def image_params(body: ImagesRequest) -> ImageParams:
    """What the stage is to draw (the stage checks counts, sides and steps against its own limits)."""
    width = height = 0
    if body.size is not None and body.size != "auto":
        size = _SIZE.fullmatch(body.size)
        if size is None:
            raise InvalidRequest(f"size {body.size!r}: WIDTHxHEIGHT in pixels (e.g. 512x512), or auto")
        width, height = int(size.group(1)), int(size.group(2))
    if body.seed is not None and not 0 <= body.seed < 2**63:
        raise InvalidRequest(f"seed {body.seed}: 0 to 2**63 - 1")
    return ImageParams(
        prompt=body.prompt,
        n=body.n,
        width=width,
        height=height,
        steps=body.num_inference_steps or 0,
        guidance=body.guidance_scale or 0.0,
        seed=body.seed,
    )


def images_response(created: int, images: list[ImageChunk], urls: list[str] | None = None) -> dict[str, Any]:
    """The images in index order, inline (``b64_json``) or, with ``urls``
    (one per image, in that order), where they can be fetched."""
    ordered = sorted(images, key=lambda c: c.index)
    first = ordered[0]
    data = (
        [{"url": url} for url in urls]
        if urls is not None
        else [{"b64_json": pybase64.b64encode_as_string(c.data)} for c in ordered]
    )
    return {
        "created": created,
        "data": data,
        "output_format": first.media_type.removeprefix("image/"),
        "size": f"{first.width}x{first.height}",
    }


def images_body(response: dict[str, Any]) -> bytes:
    """The response as JSON. Eight 512x512 PNGs are 8.4 MB of base64: the
    standard library's encoder (and its base64) took 28 ms of the event loop
    for them on a 2-vCPU machine, msgspec and pybase64 5 ms."""
    return msgspec.json.encode(response)
