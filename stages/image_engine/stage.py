"""The image-generation stage (``generate-image``): a hop that takes a
processed request and streams back its images, one ``ImageChunk`` each.

One drawing at a time per worker (a diffusion call fills its device): the
worker fetches another message only once the last one's images are done
(``has_room``). A request whose client goes stops at the next denoising
step."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from schemas.chunk import MAX_INLINE_IMAGE, ImageChunk
from schemas.errors import InvalidRequest, TooLarge
from schemas.processed import ProcessedRequest
from schemas.request import GenerateRequest
from schemas.routes import GENERATE_IMAGE
from stages.contract import HopContext, TensorStore
from stages.image_engine.engine import Drawing, ImageEngine


class ImageStage:
    role = GENERATE_IMAGE
    input_type = ProcessedRequest
    # Images are whole: a takeover draws them again from the same seed.
    resumes_stream = False

    def __init__(
        self,
        engine: ImageEngine,
        served_name: str,
        tensors: TensorStore | None = None,
        inline_bytes: int = MAX_INLINE_IMAGE,
    ) -> None:
        self.engine = engine
        self.served_name = served_name
        # Where an image over the inline limit (at most MAX_INLINE_IMAGE) waits for the bridge to read it.
        self.tensors = tensors
        self.inline_bytes = min(inline_bytes, MAX_INLINE_IMAGE)
        self._drawing: asyncio.Future[list[bytes]] | None = None
        # Every drawing on the same thread: CUDA libraries keep state per
        # thread (cuBLAS handles and workspaces, cuDNN's execution plans),
        # which a drawing on whichever thread of the loop's pool was free
        # could find cold.
        self._drawer = ThreadPoolExecutor(1, thread_name_prefix="draw")

    @property
    def models(self) -> list[str]:
        return [self.served_name]

    async def start(self) -> None:
        if self.engine.denoiser is not None:
            await asyncio.get_running_loop().run_in_executor(self._drawer, self.engine.warm_up)

    async def close(self) -> None:
        if self._drawing is not None:
            await asyncio.wait([self._drawing])
        self._drawer.shutdown(wait=False)
        self.engine.close()

    def has_room(self) -> bool:
        return self._drawing is None

    async def _draw(self, job: Drawing, cancelled: threading.Event, ctx: HopContext) -> list[bytes]:
        """The drawing, then its PNGs, each timed apart: the pipeline's own
        call is what a comparison with diffusers alone should set against it."""
        loop = asyncio.get_running_loop()
        with ctx.timed("generate_image", images=job.n, steps=job.steps):
            drawn = await loop.run_in_executor(self._drawer, self.engine.draw_pixels, job, cancelled)
        with ctx.timed("png", images=job.n):
            return await loop.run_in_executor(self._drawer, self.engine.pngs, drawn)

    def _drawn(self, drawing: asyncio.Future[list[bytes]]) -> None:
        self._drawing = None
        # A drawing whose request went away ends in DrawingCancelled that nobody awaits any more.
        if not drawing.cancelled():
            drawing.exception()

    async def run(
        self, message: GenerateRequest | ProcessedRequest, ctx: HopContext
    ) -> AsyncGenerator[ImageChunk, None]:
        if not isinstance(message, ProcessedRequest):
            raise InvalidRequest(f"{self.role} takes a processed request")
        params = message.request.image
        if params is None:
            raise InvalidRequest(f"the request asks for no image, and its route has {self.role}")
        # The processor's seed unless the client gave one: a takeover draws the same images.
        seed = params.seed if params.seed is not None else message.seed
        # The request's prompt, else what the language model before this stage wrote.
        job = self.engine.drawing(params, seed, prompt=message.stage_text)
        if self._drawing is not None:
            raise RuntimeError("one drawing at a time: the worker fetched past has_room")
        cancelled = threading.Event()
        drawing = asyncio.ensure_future(self._draw(job, cancelled, ctx))
        self._drawing = drawing
        drawing.add_done_callback(self._drawn)
        try:
            # The thread runs on past a cancel until its next step: the room comes back then.
            images = await asyncio.shield(drawing)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        sizes = [len(data) for data in images]
        if max(sizes) > self.inline_bytes and self.tensors is None:
            raise TooLarge(f"an image of {max(sizes)} bytes; at most {self.inline_bytes} ride in a reply")
        ctx.trace["image_bytes"] = float(sum(sizes))
        rid = message.request.request_id
        for index, data in enumerate(images):
            drawn = ImageChunk(rid, index, job.n, width=job.width, height=job.height, seed=seed)
            if len(data) <= self.inline_bytes:
                yield msgspec.structs.replace(drawn, data=data)
                continue
            assert self.tensors is not None
            with ctx.timed("put"):
                ref = await self.tensors.put([_as_tensor(data)], owner=rid)
            yield msgspec.structs.replace(drawn, ref=ref)


def _as_tensor(data: bytes) -> Any:
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
