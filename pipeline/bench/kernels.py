"""``mmpipe bench kernels``: what one request's engine calls cost the GPU,
compiled (``--torch-compile``, the default) against uncompiled, in one run.

The engine is built twice from one checkout (a preset's random weights, or
``--model DIR``): once as a worker builds it, once with
``torch_compile=False``. For each, a request's two calls before its first
token, through the engine's own methods, as a worker runs them:

- ``encode``: one image through preprocessing and the vision tower (its
  CUDA graph, captured on the image's second sight: two warm-ups first);
- ``prefill``: that image's prompt (the placeholder and a line of text)
  into the batch decoder's blocks, and its sequence released after;
- ``cached``: a later turn of a conversation that showed the image and
  some thousand words: its prefix found in the prefix cache, a question's
  few tokens prefilled past it (on a GPU, the graphed prefill over the
  prefix's blocks), and ``cached (modules)``, the same through the
  model's modules (the prefix's blocks read out of the pool, the rest's
  cache written back), as the engine ran it before: the baseline.

Each call is timed on the GPU (CUDA events around ``--repeats`` calls in a
row: the device's time per call, the host's launches overlapped with it)
and profiled once with ``torch.profiler``: how many kernels ran and their
summed time, and with ``--top N`` the heaviest of them. On a CPU only the
wall time is measured, and the engine compiles nothing there: both rows
then run the same code.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.bench.results import write_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="qwen2-vl-2b", help="a preset to build (random weights), unless --model")
    p.add_argument("--model", dest="kernels_model", default="", help="a checkpoint directory instead of a preset")
    p.add_argument("--image-size", dest="kernels_image_size", default="448x448", help="WIDTHxHEIGHT")
    p.add_argument("--repeats", type=int, default=20, help="calls timed in a row, after warm-ups")
    p.add_argument("--top", type=int, default=0, help="also list each call's N heaviest kernels")
    p.add_argument("--device", dest="kernels_device", default="", help="default: cuda if there is one")
    p.add_argument("--output", default="", metavar="FILE", help="also write the results here, as JSON")


def _per_call_ms(call: Callable[[], Any], repeats: int, device: str) -> float:
    import torch

    for _ in range(2):
        call()
    if not device.startswith("cuda"):
        started = time.perf_counter()
        for _ in range(repeats):
            call()
        return (time.perf_counter() - started) * 1e3 / repeats
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        call()
    end.record()
    torch.cuda.synchronize(device)
    return float(start.elapsed_time(end)) / repeats


def _kernels(call: Callable[[], Any], device: str, top: int) -> dict[str, Any]:
    """One call under the profiler: its GPU kernels (and copies), counted and summed."""
    if not device.startswith("cuda"):
        return {"kernels": None, "kernel_ms": None, "top": []}
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize(device)
    on_gpu = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    heaviest = sorted(on_gpu, key=lambda e: -e.self_device_time_total)[:top]
    return {
        "kernels": sum(e.count for e in on_gpu),
        "kernel_ms": sum(e.self_device_time_total for e in on_gpu) / 1e3,
        "top": [{"name": e.key, "calls": e.count, "ms": e.self_device_time_total / 1e3} for e in heaviest],
    }


def _measure(model_dir: Path, device: str, compiled: bool, image: Any, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from stages.torch_engine.engine import TorchEngine
    from stages.torch_engine.settings import DecodeSettings

    started = time.perf_counter()
    engine = TorchEngine(model_dir, device=device, decode=DecodeSettings(torch_compile=compiled))
    built_s = time.perf_counter() - started
    measured = _calls(engine, image, device, args)
    del engine  # its weights, pool and graphs, before the next engine is built
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"compiled": compiled, "built_s": built_s, **measured}


def _calls(engine: Any, image: Any, device: str, args: argparse.Namespace) -> dict[str, Any]:
    from schemas.processed import MediaKind
    from stages.sampling import SamplingConfig

    placeholder = engine.family.placeholder_ids[MediaKind.IMAGE]
    prompt = [placeholder, *engine.tokenizer("Describe the picture in three words, please.")["input_ids"]]
    greedy = SamplingConfig(temperature=0.0, max_tokens=1)
    # A digest, as the encoder gives media: blocks showing an item are cached by its content.
    [media] = [dataclasses.replace(m, digest="bench-image") for m in engine.encode([image])]

    def encode() -> None:
        engine.encode([image])

    def prefill() -> None:
        [(seq, _)] = engine.prefill([prompt], [[media]], [greedy])
        engine.release(seq)

    history = [*prompt, *engine.tokenizer(" The river runs past the mill and under the bridge." * 90)["input_ids"]]
    turn = [*history, *engine.tokenizer(" What colour is the sky there?")["input_ids"]]
    [(seq, _)] = engine.prefill([history], [[media]], [greedy])
    engine.step([seq])  # into the pool (and the prefix cache) wherever it prefilled
    engine.release(seq)
    cached_tokens = 0

    def cached() -> None:
        nonlocal cached_tokens
        [(seq, _)] = engine.prefill([turn], [[media]], [greedy])
        cached_tokens = seq.cached_tokens
        engine.release(seq)

    graphed = engine._slot_prefill

    def through_modules(call: Callable[[], None]) -> Callable[[], None]:
        def modules() -> None:
            if graphed is not None:
                graphed.past = False  # hits take the modules again
            try:
                call()
            finally:
                if graphed is not None:
                    graphed.past = True

        return modules

    calls = {}
    runs = (("encode", encode), ("prefill", prefill), ("cached", cached), ("cached (modules)", through_modules(cached)))
    for name, call in runs:
        calls[name] = {"ms": _per_call_ms(call, args.repeats, device), **_kernels(call, device, args.top)}
    if not cached_tokens:
        raise SystemExit("mmpipe bench kernels: the later turn found no cached prefix (is prefix caching off?)")
    tokens = len(engine._prepare(prompt, [media], [])[0])
    turn_tokens = len(engine._prepare(turn, [media], [])[0])
    return {
        "prompt_tokens": tokens,
        "image_tokens": engine.family.num_tokens(media),
        "turn_tokens": turn_tokens,
        "cached_tokens": cached_tokens,
        "calls": calls,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import torch
    import transformers
    from PIL import Image

    from pipeline.bench.load import parse_image_size

    device = args.kernels_device or ("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    w, h = parse_image_size(args.kernels_image_size)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")
    with tempfile.TemporaryDirectory(prefix="mmpipe-bench-kernels-") as tmp:
        model_dir = Path(args.kernels_model) if args.kernels_model else None
        if model_dir is None:
            from stages.models.presets import build_preset

            model_dir = build_preset(args.preset, Path(tmp) / args.preset, device)
        # The baseline first: the compiled engine's compilations stay in this process.
        runs = [_measure(model_dir, device, compiled, image, args) for compiled in (False, True)]
    return {
        "device": name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": args.kernels_model or args.preset,
        "image_size": args.kernels_image_size,
        "repeats": args.repeats,
        "runs": runs,
    }


def format_result(r: dict[str, Any]) -> str:
    eager, compiled = r["runs"]

    def cell(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    lines = [
        f"mmpipe bench kernels  device={r['device']}  torch={r['torch']}  transformers={r['transformers']}",
        f"model={r['model']}  one {r['image_size']} image, a prompt of {compiled['prompt_tokens']} tokens, "
        f"{r['repeats']} calls in a row each; cached: a turn of {compiled['turn_tokens']} tokens, "
        f"{compiled['cached_tokens']} of them cached",
        "",
        f"{'call':<18}{'uncompiled ms':>15}{'kernels':>9}{'compiled ms':>13}{'kernels':>9}{'×':>7}",
    ]
    for call in eager["calls"]:
        a, b = eager["calls"][call], compiled["calls"][call]
        lines.append(
            f"{call:<18}{a['ms']:>15.3f}{cell(a['kernels'], 'd'):>9}{b['ms']:>13.3f}{cell(b['kernels'], 'd'):>9}"
            f"{a['ms'] / b['ms']:>7.2f}"
        )
    lines.append(f"engine built in {eager['built_s']:.1f} s uncompiled, {compiled['built_s']:.1f} s compiled")
    for run in (eager, compiled):
        for call, c in run["calls"].items():
            if c["top"]:
                label = "compiled" if run["compiled"] else "uncompiled"
                lines.append(f"\n{label} {call}: {c['kernels']} kernels, {c['kernel_ms']:.3f} ms")
                lines += [f"  {k['ms']:8.3f} ms {k['calls']:5d}×  {k['name'][:100]}" for k in c["top"]]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    if args.repeats < 1 or args.top < 0:
        raise SystemExit("mmpipe bench kernels: --repeats must be at least 1, --top at least 0")
    result = run(args)
    print(format_result(result), flush=True)
    write_json(result, args.output, "bench_kernels.json")
    return 0
