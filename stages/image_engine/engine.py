"""Drawing: a diffusers text-to-image pipeline, one request's images in one
call from one seeded generator.

The generator lives on the CPU whatever the device (diffusers draws the
first latents there and moves them), so a seed gives the same starting
noise on every device; on a CPU in float32 the same seed, prompt, size,
steps and guidance give the same pixels as the pipeline called directly.
"""

from __future__ import annotations

import io
import os
import threading
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from schemas.errors import InvalidRequest
from schemas.request import ImageParams
from stages.image_engine.graphs import GraphedDenoiser
from stages.image_engine.png import encode_png


@dataclass(frozen=True)
class ImageLimits:
    """What one request may ask of the stage, and its defaults."""

    max_n: int = 8
    max_side: int = 2048
    max_steps: int = 100
    default_steps: int = 30
    default_guidance: float = 7.5
    max_prompt_chars: int = 4000


@dataclass(frozen=True)
class Drawing:
    """A request's images as the pipeline is called for them (every default resolved)."""

    prompt: str
    n: int
    width: int
    height: int
    steps: int
    guidance: float
    seed: int


class DrawingCancelled(Exception):
    """Its request went away between two denoising steps."""


class ImageEngine:
    def __init__(
        self,
        path: Path,
        device: str = "cpu",
        dtype: Any = None,
        limits: ImageLimits | None = None,
        cuda_graphs: bool = True,
    ) -> None:
        import torch
        from diffusers import DiffusionPipeline
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.disable_progress_bar()
        self.device = torch.device(device)
        self.dtype = dtype if dtype is not None else (torch.float32 if self.device.type == "cpu" else torch.bfloat16)
        self.pipeline = DiffusionPipeline.from_pretrained(str(path), dtype=self.dtype).to(self.device)
        self.pipeline.set_progress_bar_config(disable=True)
        self.limits = limits or ImageLimits()
        self.denoiser: GraphedDenoiser | None = None
        if cuda_graphs and self.device.type == "cuda":
            self.denoiser = GraphedDenoiser(self.pipeline.unet)
            self.denoiser.install()
        unet, vae_factor = self.pipeline.unet.config, int(self.pipeline.vae_scale_factor)
        self.default_size = int(unet.sample_size) * vae_factor
        # Each side through the VAE and every downsampling of the UNet, and at least Stable Diffusion's 8.
        self.multiple = max(8, vae_factor * 2 ** (len(unet.block_out_channels) - 1))
        # zlib lets go of the GIL while it compresses, so a request's images
        # are written side by side: one 512x512 PNG takes 13 ms of a core
        # (noise; Pillow's own save took 27), eight one after another about
        # 0.12 s, against the 0.38 s an H100 request of eight took beyond the
        # pipeline's own call. A request of one image has its deflate cut
        # into parts on these threads instead (7 ms on the 2-vCPU machine).
        self._writers = ThreadPoolExecutor(min(self.limits.max_n, os.cpu_count() or 1), thread_name_prefix="png")
        self._png_parts = min(4, os.cpu_count() or 1)

    def warm_up(self) -> None:
        """One image of the default size in two steps, thrown away: its
        denoiser graph captured (and cuDNN's and cuBLAS's first calls made)
        before a request waits for them, as the language engines capture
        their decode graphs before the worker says it is ready."""
        side = self.default_size
        self.draw_pixels(Drawing("warm-up", 1, side, side, 2, self.limits.default_guidance, 0))

    def close(self) -> None:
        """Let the PNG writers' threads go (a drawing in progress finishes first)."""
        self._writers.shutdown(wait=True)

    def drawing(self, params: ImageParams, seed: int, prompt: str = "") -> Drawing:
        """The call ``params`` ask for (``prompt``: the text in place of an
        empty ``params.prompt``), or InvalidRequest saying what is wrong."""
        lim = self.limits
        text = params.prompt or prompt
        if not text.strip():
            raise InvalidRequest("an image needs a prompt: 'prompt' is empty (and no text came before it)")
        if len(text) > lim.max_prompt_chars:
            raise InvalidRequest(f"the prompt is {len(text)} characters; at most {lim.max_prompt_chars}")
        if not 1 <= params.n <= lim.max_n:
            raise InvalidRequest(f"n is {params.n}; 1 to {lim.max_n} images a request")
        width, height = params.width or self.default_size, params.height or self.default_size
        for name, side in (("width", width), ("height", height)):
            if not 0 < side <= lim.max_side or side % self.multiple:
                raise InvalidRequest(
                    f"{name} {side}: a multiple of {self.multiple} from {self.multiple} to {lim.max_side} pixels"
                )
        steps = params.steps or lim.default_steps
        if not 1 <= steps <= lim.max_steps:
            raise InvalidRequest(f"steps is {steps}; 1 to {lim.max_steps}")
        guidance = params.guidance or lim.default_guidance
        if not 0 <= guidance <= 50:
            raise InvalidRequest(f"guidance is {guidance}; 0 to 50")
        return Drawing(text, params.n, width, height, steps, guidance, seed)

    def draw_pixels(self, job: Drawing, cancelled: threading.Event | None = None) -> list[Any]:
        """The job's images as uint8 arrays (H, W, C), or PIL images where
        the pipeline gives no tensors (blocks: on a thread of its own; the
        PNGs are ``pngs``'). ``cancelled`` set: DrawingCancelled at the next step."""
        import torch

        def check(pipeline: Any, step: int, timestep: Any, tensors: dict[str, Any]) -> dict[str, Any]:
            if cancelled is not None and cancelled.is_set():
                raise DrawingCancelled(f"cancelled after step {step + 1} of {job.steps}")
            return tensors

        with torch.inference_mode():
            out = self.pipeline(
                job.prompt,
                num_images_per_prompt=job.n,
                width=job.width,
                height=job.height,
                num_inference_steps=job.steps,
                guidance_scale=job.guidance,
                generator=torch.Generator("cpu").manual_seed(job.seed),
                # Tensors, made bytes on the device (pixels), not diffusers' PIL images made on the host.
                output_type="pt",
                callback_on_step_end=check,
            )
        images = out.images
        return list(pixels(images)) if isinstance(images, torch.Tensor) else list(images)

    def pngs(self, images: list[Any]) -> list[bytes]:
        """``draw_pixels``' images as PNG files' bytes, side by side on the
        writers. One image alone would leave all but one writer idle: its
        deflate is cut into parts on them instead, from this thread (a
        writer waiting on parts queued behind it could wait for ever)."""
        if len(images) == 1:
            return [png(images[0], parts=self._png_parts, pool=self._writers)]
        return list(self._writers.map(png, images))


def pixels(images: Any) -> Any:
    """A batch of images in [0, 1] (N, C, H, W) as uint8 arrays (N, H, W, C),
    by diffusers' own arithmetic (``numpy_to_pil``: float32 times 255,
    rounded half to even) but on the images' device: eight 512x512 images
    leave a GPU as 6 MB of bytes instead of 25 MB of floats, and the host
    skips diffusers' numpy arithmetic over them (about 30 ms on one core of
    the 2-vCPU machine) before the first PNG."""
    import torch

    return (images.permute(0, 2, 3, 1).float() * 255).round().to(torch.uint8).cpu().numpy()


# zlib's default, Pillow's too: files about the size Pillow wrote. Level 1
# is 3-5x faster on smooth images (8 ms against 40 for a 512x512 one on the
# 2-vCPU machine) for files about 6% larger; noise takes 12-13 ms either way.
PNG_LEVEL = 6


def png(image: Any, parts: int = 1, pool: Executor | None = None) -> bytes:
    """An image's PNG file: a PIL image, or a uint8 array (H, W, C) of RGB or
    one channel. Arrays (and plain PIL images of L, RGB or RGBA) go through
    ``encode_png`` (``parts`` and ``pool`` as it takes them): every row one
    filter, where Pillow spends about half its time choosing one a row.
    PIL images of other modes, or with info Pillow would write (an ICC
    profile, a transparent colour), through Pillow's own writer."""
    from PIL import Image

    if isinstance(image, Image.Image):
        if image.mode not in ("L", "RGB", "RGBA") or image.info:
            buf = io.BytesIO()
            image.save(buf, format="PNG")
            return buf.getvalue()
        image = np.asarray(image)
    return encode_png(image, PNG_LEVEL, parts, pool)
