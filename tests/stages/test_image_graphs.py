"""The image stage's denoiser replayed from CUDA graphs draws exactly what
its modules draw eagerly, capturing one graph a shape.

On a GPU (``--engine-device cuda``) the graphs are captured and replayed;
on a CPU, where the engine installs none, the same wrapper installed by
hand must hand every call to the UNet's own forward unchanged.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from stages.image_engine.checkpoint import TINY_TEXT_TO_IMAGE, image_model_path
from stages.image_engine.engine import Drawing, ImageEngine
from stages.image_engine.graphs import GraphedDenoiser


def _engine(device: str, graphs: bool) -> ImageEngine:
    return ImageEngine(image_model_path(TINY_TEXT_TO_IMAGE), device=device, dtype=torch.float32, cuda_graphs=graphs)


def _graphed(device: str, max_graphs: int) -> tuple[ImageEngine, GraphedDenoiser]:
    engine = _engine(device, graphs=False)
    denoiser = GraphedDenoiser(engine.pipeline.unet, max_graphs=max_graphs)
    denoiser.install()
    return engine, denoiser


@pytest.mark.parametrize("max_graphs", [8, 1])
def test_the_graphed_denoiser_draws_the_eager_pixels(engine_device: str, mmpipe_home: Path, max_graphs: int) -> None:
    eager = _engine(engine_device, graphs=False)
    graphed, denoiser = _graphed(engine_device, max_graphs)
    # One image, two (the UNet's batch 2 and 4 with guidance), one again:
    # the third replays the first graph, or captures it again when only one is kept.
    jobs = [
        Drawing("a red cube on a table", 1, 64, 64, 3, 7.5, 5),
        Drawing("two blue spheres", 2, 64, 64, 3, 7.5, 6),
        Drawing("a green cone", 1, 64, 64, 3, 7.5, 7),
    ]
    for job in jobs:
        want, got = eager.draw_pixels(job), graphed.draw_pixels(job)
        assert len(got) == job.n
        for a, b in zip(want, got, strict=True):
            assert np.array_equal(np.asarray(a), np.asarray(b))
    on_gpu = engine_device.startswith("cuda")
    assert denoiser.captures == (0 if not on_gpu else 2 if max_graphs > 1 else 3)
    assert len(denoiser.graphs) == (0 if not on_gpu else min(2, max_graphs))
    assert not denoiser.broken


def test_the_engine_graphs_its_denoiser_only_on_a_gpu(engine_device: str, mmpipe_home: Path) -> None:
    on = _engine(engine_device, graphs=True)
    off = _engine(engine_device, graphs=False)
    assert off.denoiser is None
    if engine_device.startswith("cuda"):
        assert on.denoiser is not None and on.pipeline.unet.forward is on.denoiser
        on.warm_up()  # the stage's start: the default size's one-image graph
        assert on.denoiser.captures == 1
        on.draw_pixels(Drawing("a lighthouse", 1, on.default_size, on.default_size, 3, 7.5, 1))
        assert on.denoiser.captures == 1
    else:
        assert on.denoiser is None and "forward" not in vars(on.pipeline.unet)


def test_uninstalled_the_unet_runs_its_own_forward(mmpipe_home: Path) -> None:
    engine, denoiser = _graphed("cpu", 8)
    assert engine.pipeline.unet.forward is denoiser
    denoiser.uninstall()
    assert "forward" not in vars(engine.pipeline.unet)
    assert engine.pipeline.unet.forward.__func__ is type(engine.pipeline.unet).forward
