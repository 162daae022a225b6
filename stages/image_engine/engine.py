"""Drawing: a diffusers text-to-image pipeline, one request's images in one
call from one seeded generator.

The generator lives on the CPU whatever the device (diffusers draws the
first latents there and moves them), so a seed gives the same starting
noise on every device; on a CPU in float32 the same seed, prompt, size,
steps and guidance give the same bytes as the pipeline called directly.
"""

from __future__ import annotations

import io
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from schemas.errors import InvalidRequest
from schemas.request import ImageParams


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
    def __init__(self, path: Path, device: str = "cpu", dtype: Any = None, limits: ImageLimits | None = None) -> None:
        import torch
        from diffusers import DiffusionPipeline
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.disable_progress_bar()
        self.device = torch.device(device)
        self.dtype = dtype if dtype is not None else (torch.float32 if self.device.type == "cpu" else torch.bfloat16)
        self.pipeline = DiffusionPipeline.from_pretrained(str(path), dtype=self.dtype).to(self.device)
        self.pipeline.set_progress_bar_config(disable=True)
        self.limits = limits or ImageLimits()
        unet, vae_factor = self.pipeline.unet.config, int(self.pipeline.vae_scale_factor)
        self.default_size = int(unet.sample_size) * vae_factor
        # Each side through the VAE and every downsampling of the UNet, and at least Stable Diffusion's 8.
        self.multiple = max(8, vae_factor * 2 ** (len(unet.block_out_channels) - 1))
        # Pillow lets go of the GIL while it compresses, so a request's images
        # are written side by side: one 512x512 PNG takes 25-30 ms of a core,
        # eight one after another about 0.25 s, against the 0.38 s an H100
        # request of eight took beyond the pipeline's own call.
        self._writers = ThreadPoolExecutor(min(self.limits.max_n, os.cpu_count() or 1), thread_name_prefix="png")

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

    def draw(self, job: Drawing, cancelled: threading.Event | None = None) -> list[bytes]:
        """The job's images as PNG files' bytes (blocks: on a thread of its
        own). ``cancelled`` set: DrawingCancelled at the next step."""
        return self.pngs(self.draw_pixels(job, cancelled))

    def draw_pixels(self, job: Drawing, cancelled: threading.Event | None = None) -> list[Any]:
        """The job's images as uint8 arrays (H, W, C), or PIL images where
        the pipeline gives no tensors: ``draw`` before the PNGs."""
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
        """``draw_pixels``' images as PNG files' bytes, side by side on the writers."""
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


def png(image: Any) -> bytes:
    """An image's PNG file: a PIL image, or a uint8 array (H, W, C) of RGB or one channel."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        # One channel: a 2-D array, which Pillow makes a grayscale ("L") image.
        image = Image.fromarray(image.squeeze(-1) if image.shape[-1] == 1 else image)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()
