"""``mmpipe bench encode``: encoder throughput per image, one image per call
against several requests' images in one call (``--encode-batch``), beside
plain transformers on the same model, in one run.

- The model: a preset checkpoint (real-size shapes, random bf16 weights)
  built into a temporary directory, or ``--model DIR``.
- transformers: ``get_image_features`` on the image processor's output, for
  one image and for ``--images`` images in one call (what the issue's
  baseline measured), preprocessing outside the clock.
- mmpipe: the encode worker's own path, ``EncodeBatcher`` over the engine,
  preprocessing (the PIL image processor) inside the clock as the worker
  pays it: ``--images`` one-image requests one after another with
  ``--encode-batch 1``, then the same requests arriving together with
  ``--encode-batch N`` (one tower call).
- Per-image throughput ratio = (images / batched seconds) / (1 / one-image
  seconds), median of ``--repeats`` after a warm-up of each.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path
from typing import Any

from pipeline.bench import median_seconds
from pipeline.bench.results import write_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="qwen2-vl-2b", help="a preset to build (random weights), unless --model")
    p.add_argument("--model", dest="encode_model", default="", help="a checkpoint directory instead of a preset")
    p.add_argument("--images", type=int, default=8, help="images (one per request) encoded together")
    p.add_argument("--image-size", dest="encode_image_size", default="448x448", help="WIDTHxHEIGHT")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", dest="encode_device", default="", help="default: cuda if there is one")
    p.add_argument("--output", default="", metavar="FILE", help="also write the results here, as JSON")


def _images(n: int, size: tuple[int, int], seed: int = 0) -> list[Any]:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    w, h = size
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB") for _ in range(n)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers

    from pipeline.bench.load import parse_image_size
    from stages.torch_engine.encode_batcher import EncodeBatcher
    from stages.torch_engine.engine import TorchEngine
    from stages.torch_engine.scheduler import EngineThread
    from stages.torch_engine.settings import DecodeSettings

    device = args.encode_device or ("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)

    with tempfile.TemporaryDirectory(prefix="mmpipe-bench-encode-") as tmp:
        model_dir = Path(args.encode_model) if args.encode_model else None
        if model_dir is None:
            from stages.models.presets import build_preset

            model_dir = build_preset(args.preset, Path(tmp) / args.preset, device)
        engine = TorchEngine(model_dir, device=device, decode=DecodeSettings(batched=False))
        n = args.images
        images = _images(n, parse_image_size(args.encode_image_size))
        family: Any = engine.family
        model = engine.model

        vision = model.model.visual.config
        packed = vision._attn_implementation
        towers_own = "sdpa"

        def hf(batch: list[Any]) -> Any:
            pixels, grid = family.preprocess(batch)
            pixels, grid = pixels.to(device, model.dtype), grid.to(device)
            return lambda: model.get_image_features(pixels, grid)

        # transformers as it comes: the towers' own attention, image by image.
        vision._attn_implementation = towers_own
        with torch.inference_mode():
            hf_one = median_seconds(hf(images[:1]), args.repeats, sync)
            hf_all = median_seconds(hf(images), args.repeats, sync)

        thread = EngineThread()
        alone = EncodeBatcher(engine, thread, max_items=1)
        together = EncodeBatcher(engine, thread, max_items=n)

        async def one_by_one() -> None:
            for image in images:
                await alone.encode([image])

        async def at_once() -> None:
            await asyncio.gather(*(together.encode([image]) for image in images))

        def mmpipe(attention: str) -> tuple[float, float, float, float]:
            vision._attn_implementation = attention
            one = median_seconds(lambda: asyncio.run(alone.encode(images[:1])), args.repeats, sync)
            serial = median_seconds(lambda: asyncio.run(one_by_one()), args.repeats, sync)
            calls = together.calls
            batched = median_seconds(lambda: asyncio.run(at_once()), args.repeats, sync)
            return one, serial, batched, (together.calls - calls) / (args.repeats + 1)

        mm_one, mm_serial, mm_all, calls_per_run = mmpipe(packed)
        own = mmpipe(towers_own) if packed != towers_own else None
        vision._attn_implementation = packed
        thread.close()
        tokens = sum(e.num_tokens for e in engine.encode(images[:1]))
    return {
        "device": name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": args.encode_model or args.preset,
        "images": n,
        "image_size": args.encode_image_size,
        "tokens_per_image": tokens,
        "hf_one_ms": hf_one * 1e3,
        "hf_batch_ms": hf_all * 1e3,
        "hf_ratio": (n / hf_all) / (1 / hf_one),
        "mmpipe_one_ms": mm_one * 1e3,
        "mmpipe_serial_ms": mm_serial * 1e3,
        "mmpipe_batch_ms": mm_all * 1e3,
        "mmpipe_calls_per_batch": calls_per_run,
        "mmpipe_ratio": (n / mm_all) / (1 / mm_one),
        "mmpipe_vs_serial": mm_serial / mm_all,
        "mmpipe_attention": packed,
        # The same path with the towers' own attention (where mmpipe packs).
        "towers_own_one_ms": own[0] * 1e3 if own else None,
        "towers_own_batch_ms": own[2] * 1e3 if own else None,
        "towers_own_ratio": (n / own[2]) / (1 / own[0]) if own else None,
    }


def format_result(r: dict[str, Any]) -> str:
    n = r["images"]
    return "\n".join(
        [
            f"mmpipe bench encode  device={r['device']}  torch={r['torch']}  transformers={r['transformers']}",
            f"model={r['model']}  {n} images of {r['image_size']} ({r['tokens_per_image']} tokens each)",
            "",
            f"{'':<34}{'1 image ms':>12}{f'{n} images ms':>14}{'per-image ×':>13}",
            f"{'transformers get_image_features':<34}{r['hf_one_ms']:>12.2f}{r['hf_batch_ms']:>14.2f}"
            f"{r['hf_ratio']:>13.2f}",
            f"{'mmpipe --encode-batch ' + str(n):<34}{r['mmpipe_one_ms']:>12.2f}{r['mmpipe_batch_ms']:>14.2f}"
            f"{r['mmpipe_ratio']:>13.2f}",
            *(
                [
                    f"{'  the same, towers own attention':<34}{r['towers_own_one_ms']:>12.2f}"
                    f"{r['towers_own_batch_ms']:>14.2f}{r['towers_own_ratio']:>13.2f}"
                ]
                if r["towers_own_ratio"] is not None
                else []
            ),
            f"mmpipe's vision attention: {r['mmpipe_attention']}",
            "",
            f"mmpipe: {n} one-image requests one after another {r['mmpipe_serial_ms']:.2f} ms; arriving together "
            f"{r['mmpipe_batch_ms']:.2f} ms in {r['mmpipe_calls_per_batch']:.1f} encoder call(s): "
            f"{r['mmpipe_vs_serial']:.2f}× the throughput",
            "per-image × = (images / seconds of the batched call) / (1 / seconds of the one-image call); "
            "mmpipe's times include preprocessing",
        ]
    )


def main(args: argparse.Namespace) -> int:
    if args.images < 1 or args.repeats < 1:
        raise SystemExit("mmpipe bench encode: --images and --repeats must be at least 1")
    result = run(args)
    print(format_result(result), flush=True)
    write_json(result, args.output, "bench_encode.json")
    return 0


if __name__ == "__main__":  # python -m pipeline.bench.encode: on a GPU host
    parser = argparse.ArgumentParser(prog="python -m pipeline.bench.encode", description=__doc__.split("\n")[0])
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
