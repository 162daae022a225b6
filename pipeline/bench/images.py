"""``mmpipe bench images``: the image-generation stage against the diffusers
pipeline alone, in one run.

- The model: ``--model DIR`` (a diffusers pipeline folder), else the
  ``sd15-shape`` preset (Stable Diffusion 1.5's architecture and sizes,
  random weights, bf16) built into a temporary folder, or ``tiny-sd``.
- diffusers alone: the pipeline in this process, ``--batches`` images a
  call from one prompt (``num_images_per_prompt``), the median of
  ``--repeats`` calls after a warm-up, PIL images out; called from the main
  thread and from a thread of its own (as the stage draws), before the
  stack runs and again after it (a card that slows over the run shows as
  the two differing), and the fastest of the four is the baseline.
- mmpipe: ``mmpipe up --image-model`` on the same device, the same calls as
  ``POST /v1/images/generations`` with ``n`` images, one at a time, through
  the bridge, NATS, the worker and back as PNGs (the stage's own cost:
  its queue, the PNG encoding, the reply, base64 and HTTP).
- images/s of each, and mmpipe's over diffusers'; and the seconds the
  stage's own drawing took (its hop trace's ``generate_image_s``: the
  pipeline's call, its images made bytes on the device; median of the
  timed requests) beside diffusers' call, then its PNGs (``png_s``): what
  the worker adds inside the drawing, apart from the PNGs, and what the
  hop and the reply add around them.
- The stage's defaults replay its denoiser from CUDA graphs on a GPU,
  which the pipeline alone does not; ``--also-eager`` runs a second stack
  with ``--no-image-cuda-graphs``, the same kernels as the pipeline's own
  call, so the stage's cost over diffusers shows apart from the graphs' gain.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pipeline.bench import median_seconds
from pipeline.bench.results import write_json

PROMPT = "a lighthouse on a cliff at dusk, oil painting"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", dest="images_model", default="", help="a diffusers pipeline folder, unless --preset")
    p.add_argument(
        "--preset", dest="images_preset", default="sd15-shape", help="sd15-shape (random weights) or tiny-sd"
    )
    p.add_argument("--batches", default="1,8", help="images a request (n), comma separated")
    p.add_argument("--steps", type=int, default=30, help="denoising steps")
    p.add_argument("--size", dest="images_size", default="512x512", help="WIDTHxHEIGHT")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", dest="images_device", default="", help="default: cuda if there is one")
    p.add_argument(
        "--also-eager",
        action="store_true",
        help="also a stack with --no-image-cuda-graphs: the stage on the pipeline's own kernels, its cost over them",
    )
    p.add_argument("--json", dest="images_json", action="store_true", help="print the rows as JSON")
    p.add_argument("--output", default="", metavar="FILE", help="also write the results here, as JSON")


def diffusers_alone(
    path: Path, device: str, batches: list[int], steps: int, size: tuple[int, int], repeats: int
) -> dict[int, tuple[float, float]]:
    """Seconds a call of each batch takes, the pipeline alone: called from
    this thread, and from a thread of its own. At one image a call an
    H100's UNet is bound by launching kernels from Python, and the two have
    differed by half (1.36 s from the main thread against 0.89 s for the
    stage's drawing on its thread, 2026-12-06)."""
    import torch
    from diffusers import DiffusionPipeline

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    pipe: Any = DiffusionPipeline.from_pretrained(str(path), dtype=dtype).to(device)
    pipe.set_progress_bar_config(disable=True)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    width, height = size
    out = {}
    for n in batches:

        def call(n: int = n) -> Any:
            return pipe(
                PROMPT,
                num_images_per_prompt=n,
                width=width,
                height=height,
                num_inference_steps=steps,
                generator=torch.Generator("cpu").manual_seed(0),
            ).images

        main = median_seconds(call, repeats, sync)
        with ThreadPoolExecutor(1, thread_name_prefix="draw") as own:
            threaded = own.submit(median_seconds, call, repeats, sync).result()
        out[n] = (main, threaded)
    pipe = None
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # the stack that follows needs the memory
    return out


def through_mmpipe(
    path: Path,
    device: str,
    batches: list[int],
    steps: int,
    size: tuple[int, int],
    repeats: int,
    up_args: tuple[str, ...] = (),
) -> tuple[dict[int, float], dict[int, tuple[float, float]]]:
    """Seconds a request of each batch takes, through ``mmpipe up``, and
    seconds the stage's drawing and its PNGs took of it (medians of the
    timed requests)."""
    import openai

    from pipeline.bench.modes import mmpipe_up

    out = {}
    asked: dict[int, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="mmpipe-bench-images-") as tmp:
        # INFO: the worker logs each request's hop trace, its drawing's seconds in it.
        extra = ("--device", device, "--image-model", str(path), "--log-level", "INFO", *up_args)
        with mmpipe_up("epd", "tiny-qwen2-vl", "nats", Path(tmp), extra=extra) as (url, _):
            with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=3600) as client:
                # The bridge's ready line may come before the image worker's.
                deadline = time.monotonic() + 300
                while True:
                    try:
                        client.images.generate(prompt="warm", extra_body={"num_inference_steps": 1})
                        break
                    except openai.APIStatusError as exc:
                        if exc.status_code != 503 or time.monotonic() > deadline:
                            raise
                        time.sleep(1)
                for n in batches:

                    def call(n: int = n) -> Any:
                        reply = client.images.generate(
                            prompt=PROMPT,
                            n=n,
                            size=f"{size[0]}x{size[1]}",
                            extra_body={"num_inference_steps": steps, "seed": 0},
                        )
                        asked.setdefault(n, []).append(reply._request_id or "")
                        return reply

                    out[n] = median_seconds(call, repeats, lambda: None)
        # Read once the stack has stopped: every worker's log is in by then.
        drawn = drawing_seconds(Path(tmp) / "up.log")
    # Each batch's first request is median_seconds' unmeasured one.
    draw = {
        n: (
            statistics.median(drawn[rid][0] for rid in asked[n][1:]),
            statistics.median(drawn[rid][1] for rid in asked[n][1:]),
        )
        for n in batches
    }
    return out, draw


def drawing_seconds(log: Path) -> dict[str, tuple[float, float]]:
    """Request id -> the image stage's ``generate_image_s`` (the pipeline's
    call) and ``png_s`` (its PNGs), from the hop trace lines (JSON) of a
    stack's log."""
    found = {}
    for line in log.read_text(errors="replace").splitlines():
        if '"hop_trace"' not in line or "generate_image_s" not in line:
            continue
        try:
            trace = json.loads(line[line.index("{") :])
        except ValueError:
            continue
        found[trace["request_id"]] = (float(trace["generate_image_s"]), float(trace["png_s"]))
    return found


def _model(args: argparse.Namespace, scratch: Path) -> Path:
    if args.images_model:
        return Path(args.images_model)
    from stages.image_engine.checkpoint import SD15_SHAPE, TINY_TEXT_TO_IMAGE, build_sd15_shape, image_model_path

    if args.images_preset == TINY_TEXT_TO_IMAGE:
        return image_model_path(TINY_TEXT_TO_IMAGE)
    if args.images_preset != SD15_SHAPE:
        raise SystemExit(f"--preset {args.images_preset!r}: {SD15_SHAPE} or {TINY_TEXT_TO_IMAGE}")
    out = scratch / SD15_SHAPE
    print(f"building {SD15_SHAPE} (random weights) in {out} ...", file=sys.stderr, flush=True)
    build_sd15_shape(out)
    return out


def main(args: argparse.Namespace) -> int:
    import torch

    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    width, height = (int(v) for v in args.images_size.lower().split("x"))
    device = args.images_device or ("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory(prefix="mmpipe-bench-images-model-") as scratch:
        path = _model(args, Path(scratch))
        alone = diffusers_alone(path, device, batches, args.steps, (width, height), args.repeats)
        served, draw = through_mmpipe(path, device, batches, args.steps, (width, height), args.repeats)
        eager = (
            through_mmpipe(
                path, device, batches, args.steps, (width, height), args.repeats, ("--no-image-cuda-graphs",)
            )
            if args.also_eager
            else None
        )
        after = diffusers_alone(path, device, batches, args.steps, (width, height), args.repeats)
    card = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    fastest = {n: min(*alone[n], *after[n]) for n in batches}
    rows = [
        {
            "batch": n,
            "device": card,
            "steps": args.steps,
            "size": f"{width}x{height}",
            "diffusers_images_per_s": n / fastest[n],
            "mmpipe_images_per_s": n / served[n],
            "ratio": fastest[n] / served[n],
            "diffusers_call_s": fastest[n],
            "diffusers_main_thread_s": alone[n][0],
            "diffusers_own_thread_s": alone[n][1],
            "diffusers_after_main_thread_s": after[n][0],
            "diffusers_after_own_thread_s": after[n][1],
            "stage_drawing_s": draw[n][0],
            "stage_png_s": draw[n][1],
            "request_s": served[n],
        }
        | (
            {
                "eager_ratio": fastest[n] / eager[0][n],
                "eager_stage_drawing_s": eager[1][n][0],
                "eager_stage_png_s": eager[1][n][1],
                "eager_request_s": eager[0][n],
            }
            if eager
            else {}
        )
        for n in batches
    ]
    write_json(rows, args.output, "bench_images.json")
    if args.images_json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"mmpipe bench images  model={path.name}  device={card}  size={width}x{height}  steps={args.steps}")
    print(
        "diffusers: the fastest of its calls from the main thread and from a thread of its own, "
        "before mmpipe's stack ran and after"
    )
    head = "diffusers call s main / own thread"
    print(
        f"{'batch':>5} {'diffusers img/s':>16} {'mmpipe img/s':>13} {'mmpipe/diffusers':>17}"
        f" {head + ', before':>43} {'after':>15} {'stage drawing s':>16} {'png s':>6} {'request s':>10}"
    )
    for r in rows:
        before = f"{r['diffusers_main_thread_s']:.3f} / {r['diffusers_own_thread_s']:.3f}"
        later = f"{r['diffusers_after_main_thread_s']:.3f} / {r['diffusers_after_own_thread_s']:.3f}"
        print(
            f"{r['batch']:>5} {r['diffusers_images_per_s']:>16.3f} {r['mmpipe_images_per_s']:>13.3f} "
            f"{r['ratio']:>17.3f} {before:>43} {later:>15} {r['stage_drawing_s']:>16.3f} {r['stage_png_s']:>6.3f}"
            f" {r['request_s']:>10.3f}"
        )
    if eager:
        print("the stage without CUDA graphs (--no-image-cuda-graphs), its own stack:")
        print(f"{'batch':>5} {'mmpipe/diffusers':>17} {'stage drawing s':>16} {'png s':>6} {'request s':>10}")
        for r in rows:
            print(
                f"{r['batch']:>5} {r['eager_ratio']:>17.3f} {r['eager_stage_drawing_s']:>16.3f}"
                f" {r['eager_stage_png_s']:>6.3f} {r['eager_request_s']:>10.3f}"
            )
    return 0
