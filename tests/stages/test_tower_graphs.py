"""The vision tower from CUDA graphs (stages/families/tower_graphs.py): the
eager tower's features, a graph per grid captured the second time it comes,
and eager again where a capture fails. On the CPU (CI) no graph is made and
the features are the eager tower's; with --engine-device cuda the graphs."""

from __future__ import annotations

from pathlib import Path

import torch

from stages.families.tower_graphs import TowerGraphs
from stages.models import builtin_path
from stages.torch_engine.engine import TorchEngine
from stages.torch_engine.settings import DecodeSettings
from tests.e2e.conftest import gradient


def _eager(engine: TorchEngine, width: int, height: int) -> torch.Tensor:
    fam, model = engine.family, engine.model
    pixels, grid = fam.preprocess([gradient(width, height, 3)])  # type: ignore[attr-defined]
    with torch.inference_mode():
        out = model.get_image_features(pixels.to(engine.device, model.dtype), grid.to(engine.device))
    feats = out.pooler_output if hasattr(out, "pooler_output") else out
    return torch.cat(list(feats)) if isinstance(feats, (list, tuple)) else feats


def test_a_grid_seen_twice_replays_its_graph_with_the_eager_towers_features(
    mmpipe_home: Path, engine_device: str
) -> None:
    dtype = torch.float32 if engine_device == "cpu" else torch.bfloat16
    engine = TorchEngine(builtin_path("tiny-qwen2-vl"), device=engine_device, dtype=dtype)
    graphs = engine.family.tower_graphs
    on_gpu = engine.device.type == "cuda"
    assert graphs.enabled == on_gpu
    want = _eager(engine, 60, 44)
    for n in range(1, 4):  # eager, captured, replayed
        [item] = engine.encode([gradient(60, 44, 3)])
        torch.testing.assert_close(item.embeddings, want, atol=0, rtol=0)
        assert len(graphs) == (min(n - 1, 1) if on_gpu else 0)
    other = _eager(engine, 84, 56)
    [item] = engine.encode([gradient(84, 56, 3)])  # a grid not seen before: eager, no capture
    torch.testing.assert_close(item.embeddings, other, atol=0, rtol=0)
    assert len(graphs) == (1 if on_gpu else 0)


def test_a_capture_that_fails_leaves_the_tower_eager(engine_device: str) -> None:
    device = torch.device(engine_device)
    graphs = TowerGraphs(capacity=2)
    reads_back = 0

    def tower(x: torch.Tensor) -> torch.Tensor:
        nonlocal reads_back
        reads_back += int(x.sum().item() > 0)  # a host sync: no graph can hold it
        return x * 2

    x = torch.ones(4, device=device)
    for _ in range(3):
        torch.testing.assert_close(graphs("k", tower, {"x": x}), x * 2)
    assert len(graphs) == 0
    assert graphs.enabled == (device.type != "cuda")  # the failed capture turned them off on a GPU
    assert reads_back >= 3


def test_preprocessing_on_the_device_gives_the_processors_pixels(mmpipe_home: Path, engine_device: str) -> None:
    """For images the processor would not resize; the others are left to it."""
    from stages.families.qwen2_vl import Qwen2VLFamily

    engine = TorchEngine(builtin_path("tiny-qwen2-vl"), device=engine_device, dtype=torch.float32)
    fam = engine.family
    assert isinstance(fam, Qwen2VLFamily)
    native = [gradient(56, 84, 3), gradient(112, 56, 3)]  # multiples of patch × merge (28 here)
    got = fam.preprocess_on(native, engine.device, torch.float32)
    assert got is not None
    want_pixels, want_grid = fam.preprocess(native)
    assert torch.equal(got[1], want_grid)
    if engine.device.type == "cpu":
        assert torch.equal(got[0], want_pixels)
    else:  # the GPU's float division may round the last bit another way
        torch.testing.assert_close(got[0].cpu(), want_pixels, atol=1e-6, rtol=1e-6)
    assert fam.preprocess_on([gradient(60, 44, 3)], engine.device, torch.float32) is None  # would be resized
    assert fam.preprocess_on([gradient(56, 56, 3).convert("L")], engine.device, torch.float32) is None


def test_images_prepared_off_the_engine_thread_encode_to_the_same_embeddings(
    mmpipe_home: Path, engine_device: str
) -> None:
    """``prepare`` runs the processor for what the device will not take (on
    the CPU: every image); ``encode`` of its output equals ``encode`` of the
    images themselves, whichever mix of the two it is given."""
    from stages.families import PreparedImage

    engine = TorchEngine(builtin_path("tiny-qwen2-vl"), device=engine_device, dtype=torch.float32)
    native, resized, grey = gradient(56, 84, 3), gradient(60, 44, 3), gradient(56, 56, 3).convert("L")
    images = [native, resized, grey]
    prepared = engine.prepare(list(images))
    on_device = engine.device.type == "cuda"
    assert [isinstance(p, PreparedImage) for p in prepared] == [not on_device, True, True]
    assert isinstance(prepared[1], PreparedImage)
    want_pixels, want_grid = engine.family.preprocess([resized])  # type: ignore[attr-defined]
    assert torch.equal(prepared[1].pixel_values, want_pixels) and torch.equal(prepared[1].grid, want_grid)
    want = engine.encode(images)
    for given in (prepared, [prepared[0], resized, prepared[2]]):
        got = engine.encode(list(given))
        assert [g.grid_thw for g in got] == [w.grid_thw for w in want]
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g.embeddings, w.embeddings)


def test_the_compiled_tower_gives_the_uncompiled_towers_features(mmpipe_home: Path, engine_device: str) -> None:
    """Each vision block through torch.compile (at start on a GPU,
    --torch-compile): in bf16 the uncompiled tower's features, bit for bit
    on the CPU, within bf16 rounding on a GPU, graphed or not."""
    decode = DecodeSettings(torch_compile=False)
    engine = TorchEngine(builtin_path("tiny-qwen2-vl"), device=engine_device, dtype=torch.bfloat16, decode=decode)
    blocks = engine.model.model.visual.blocks
    assert blocks[0]._compiled_call_impl is None
    want = [engine.encode([gradient(60, 44, 3)])[0].embeddings for _ in range(3)]  # eager, captured, replayed
    engine.family.tower_graphs = TowerGraphs(8 if engine.device.type == "cuda" else 0)
    engine.family.compile_tower(engine.model)
    assert all(block._compiled_call_impl is not None for block in blocks)
    exact = {"atol": 0, "rtol": 0} if engine_device == "cpu" else {"atol": 5e-2, "rtol": 5e-2}
    for expected in want:
        got = engine.encode([gradient(60, 44, 3)])[0].embeddings
        torch.testing.assert_close(got.float(), expected.float(), **exact)
