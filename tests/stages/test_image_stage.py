"""The image-generation stage (stages/image_engine) on the built-in tiny
text-to-image pipeline, against diffusers' own pipeline called directly on
the same checkpoint: the same seed draws the same PNG bytes on this CPU in
float32; bad sizes, counts and prompts are refused before any drawing; a
cancelled request stops at its next step."""

from __future__ import annotations

import asyncio
import io
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from schemas.chunk import MAX_INLINE_IMAGE, ImageChunk
from schemas.errors import InvalidRequest, TooLarge
from schemas.processed import ProcessedRequest
from schemas.request import GenerateRequest, ImageParams
from schemas.routes import GENERATE_IMAGE
from stages.contract import HopContext
from stages.image_engine.checkpoint import TINY_TEXT_TO_IMAGE, image_model_path
from stages.image_engine.engine import ImageEngine, ImageLimits, pixels, png
from stages.image_engine.stage import ImageStage
from tests.polling import eventually


def _request(params: ImageParams, seed: int = 11) -> ProcessedRequest:
    asked = GenerateRequest("img-1", TINY_TEXT_TO_IMAGE, [], image=params)
    return ProcessedRequest(asked, [], [], [GENERATE_IMAGE], max_tokens=0, seed=seed)


async def _draw(stage: ImageStage, params: ImageParams, seed: int = 11) -> list[ImageChunk]:
    return [chunk async for chunk in stage.run(_request(params, seed), HopContext())]


def _reference(path: Path, params: ImageParams, seed: int) -> list[tuple[str, tuple[int, int], bytes]]:
    """diffusers alone: the checkpoint's pipeline called with the same
    arguments, its PIL images' mode, size and pixel bytes."""
    from diffusers import StableDiffusionPipeline

    pipeline: Any = StableDiffusionPipeline.from_pretrained(str(path), dtype=torch.float32)
    pipeline.set_progress_bar_config(disable=True)
    out = pipeline(
        params.prompt,
        num_images_per_prompt=params.n,
        width=params.width,
        height=params.height,
        num_inference_steps=params.steps,
        guidance_scale=params.guidance,
        generator=torch.Generator("cpu").manual_seed(seed),
    )
    return [(image.mode, image.size, image.tobytes()) for image in out.images]


def _decoded(data: bytes) -> tuple[str, tuple[int, int], bytes]:
    """A PNG file the stage wrote, read back by Pillow (not by the stage's
    own writer): its mode, size and pixel bytes. The files themselves
    differ from Pillow's (the stage filters every row the same way)."""
    with Image.open(io.BytesIO(data)) as image:
        image.load()
        return image.mode, image.size, image.tobytes()


@pytest.fixture
def stage(mmpipe_home: Path) -> ImageStage:
    return ImageStage(ImageEngine(image_model_path(TINY_TEXT_TO_IMAGE), limits=ImageLimits(max_steps=400)), "tiny-sd")


async def test_a_seed_draws_the_pipelines_own_bytes(stage: ImageStage, mmpipe_home: Path) -> None:
    path = image_model_path(TINY_TEXT_TO_IMAGE)
    assert (path / "model_index.json").is_file()
    params = ImageParams(prompt="a red cat on a blue mat", n=2, width=64, height=48, steps=3, guidance=7.5)
    chunks = await _draw(stage, params, seed=11)
    assert [(c.index, c.count, c.seed, c.media_type) for c in chunks] == [
        (0, 2, 11, "image/png"),
        (1, 2, 11, "image/png"),
    ]
    assert [_decoded(c.data) for c in chunks] == _reference(path, params, 11)
    assert _decoded(chunks[0].data) != _decoded(chunks[1].data)  # two draws of one generator
    with Image.open(io.BytesIO(chunks[0].data)) as image:
        assert (image.size, image.mode) == ((64, 48), "RGB")
    # The client's seed beats the processor's; another seed, another image.
    again = await _draw(stage, ImageParams(prompt=params.prompt, width=64, height=48, steps=3, seed=5), seed=11)
    assert again[0].seed == 5 and _decoded(again[0].data) != _decoded(chunks[0].data)
    assert _decoded(again[0].data) == _reference(path, ImageParams(params.prompt, 1, 64, 48, 3, 7.5), 5)[0]
    assert image_model_path(TINY_TEXT_TO_IMAGE) == path  # built once, then found


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pixels_are_diffusers_own_bytes_halves_and_all(dtype: torch.dtype) -> None:
    """The device's uint8 of a batch equals diffusers' host path (float32
    numpy, times 255, rounded half to even), at every half step too."""
    from diffusers.image_processor import VaeImageProcessor

    halves = (torch.arange(512, dtype=torch.float32) / 2 / 255).clamp(0, 1)
    images = torch.cat([halves[: 3 * 8 * 8].reshape(1, 3, 8, 8), torch.rand(2, 3, 8, 8)]).to(dtype)
    want = [image.tobytes() for image in VaeImageProcessor.numpy_to_pil(VaeImageProcessor.pt_to_numpy(images))]
    assert [array.tobytes() for array in pixels(images)] == want
    gray = images[:, :1]
    want_gray = VaeImageProcessor.numpy_to_pil(VaeImageProcessor.pt_to_numpy(gray))[0]
    with Image.open(io.BytesIO(png(pixels(gray)[0]))) as image:
        assert (image.mode, image.tobytes()) == ("L", want_gray.tobytes())


@pytest.mark.parametrize(
    ("params", "says"),
    [
        (ImageParams(prompt=""), "needs a prompt"),
        (ImageParams(prompt="   "), "needs a prompt"),
        (ImageParams(prompt="cat", n=0), "n is 0"),
        (ImageParams(prompt="cat", n=9), "n is 9"),
        (ImageParams(prompt="cat", width=60), "width 60: a multiple of 8"),
        (ImageParams(prompt="cat", height=4096), "height 4096"),
        (ImageParams(prompt="cat", steps=401), "steps is 401"),
        (ImageParams(prompt="cat", guidance=-1.0), "guidance is -1.0"),
        (ImageParams(prompt="x" * 4001), "4001 characters"),
    ],
)
async def test_a_bad_request_is_refused_before_anything_is_drawn(
    stage: ImageStage, params: ImageParams, says: str
) -> None:
    with pytest.raises(InvalidRequest, match=says) as refused:
        await _draw(stage, params)
    assert refused.value.http_status == 400
    assert stage.has_room()


async def test_a_request_with_no_image_is_refused(stage: ImageStage) -> None:
    asked = GenerateRequest("img-2", TINY_TEXT_TO_IMAGE, [])
    with pytest.raises(InvalidRequest, match="asks for no image"):
        [c async for c in stage.run(ProcessedRequest(asked, [], [], [GENERATE_IMAGE], 0, 1), HopContext())]


async def test_a_cancelled_drawing_stops_at_its_next_step(stage: ImageStage) -> None:
    steps: list[int] = []
    real = stage.engine.pipeline.scheduler.step

    def counted(*args: Any, **kwargs: Any) -> Any:
        steps.append(1)
        return real(*args, **kwargs)

    stage.engine.pipeline.scheduler.step = counted
    task = asyncio.ensure_future(_draw(stage, ImageParams(prompt="a long one", steps=400)))
    await eventually(lambda: len(steps) >= 2, within=30.0)
    assert not stage.has_room()  # one drawing at a time: the worker fetches nothing more
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await eventually(stage.has_room, within=30.0)  # the thread stopped at a step, not after all 400
    assert len(steps) < 400


async def test_an_image_over_the_inline_limit_with_nowhere_to_wait_is_refused_whole(stage: ImageStage) -> None:
    """Without a tensor transport to hold it, an image over the inline limit
    is a 413 (nothing of the request is sent)."""
    small = ImageStage(stage.engine, "tiny-sd", tensors=None, inline_bytes=1000)
    with pytest.raises(TooLarge, match="at most 1000") as refused:
        await _draw(small, ImageParams(prompt="cat", n=2, steps=2))
    assert refused.value.http_status == 413
    # The limit is at most 1 MiB, whatever is asked.
    assert ImageStage(stage.engine, "tiny-sd", inline_bytes=1 << 30).inline_bytes == MAX_INLINE_IMAGE


async def test_every_drawing_runs_on_the_same_thread(stage: ImageStage) -> None:
    """CUDA libraries keep state per thread (cuBLAS workspaces, cuDNN's
    plans): drawings stay on one thread of the stage's, also while the
    loop's shared pool has other work that would take its idle threads."""
    threads: list[int] = []
    real = stage.engine.pipeline.scheduler.step

    def noted(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.get_ident())
        return real(*args, **kwargs)

    stage.engine.pipeline.scheduler.step = noted
    release = threading.Event()
    for seed in range(3):
        # The loop's pool busy with a blocked call while each drawing starts.
        blocked = asyncio.ensure_future(asyncio.to_thread(release.wait, 30))
        await _draw(stage, ImageParams(prompt="cat", steps=2), seed=seed)
        release.set()
        await blocked
        release.clear()
    assert len(threads) == 6 and len(set(threads)) == 1
    assert threads[0] != threading.get_ident()  # not the event loop's


async def test_closing_the_stage_lets_its_threads_go(stage: ImageStage) -> None:
    before = set(threading.enumerate())
    await _draw(stage, ImageParams(prompt="cat", steps=1, n=2), seed=0)
    started = [t for t in set(threading.enumerate()) - before if t.name.startswith(("png", "draw"))]
    assert {t.name[:3] for t in started} == {"png", "dra"}
    await stage.close()
    for thread in started:
        thread.join(timeout=10)
    assert not [t for t in started if t.is_alive()]
