"""Skinny GEMMs of a decode step: cuBLAS (F.linear) against stages/torch_engine/kernels/triton_linear.py.

    python -m pipeline.bench.linear                  # everything, ~3-4 min on an H100
    python -m pipeline.bench.linear --no-sweep       # cuBLAS vs the heuristic only (~30 s)
    python -m pipeline.bench.linear --only 2b --ms 32

Needs torch with CUDA and Triton, and this checkout on the path (as
``pipeline.bench.decode``, it runs where the rest of mmpipe is not installed).

Each shape: 28 distinct weights (lm_head: 1) cycled in a CUDA graph, so no
weight stays in L2 (50 MB); us per call and weight bytes / time. The Triton
times include the partials' reduce (sum over S + cast to bf16, torch ops,
as eager runs it; under torch.compile it fuses into the next pointwise
kernel, so "kernel" -- the partials alone -- is the compiled step's cost).
The sweep is coordinate descent: (block_n, split_k) at block_k 128, 4 warps,
4 stages; then (block_k, warps, stages) at the best of those; then
(block_n, split_k) again.
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F

from stages.torch_engine.kernels import triton_linear as tlin
from stages.torch_engine.kernels.triton_linear import Config

SHAPES = [  # (model, name, N, K)
    ("2b", "qkv", 2048, 1536),
    ("2b", "o", 1536, 1536),
    ("2b", "gate_up", 17920, 1536),
    ("2b", "down", 1536, 8960),
    ("2b", "lm_head", 151936, 1536),
    ("7b", "qkv", 4608, 3584),
    ("7b", "o", 3584, 3584),
    ("7b", "gate_up", 37888, 3584),
    ("7b", "down", 3584, 18944),
]
SMEM = 220 * 1024  # an H100's 227 KB less Triton's own: configs past it fail to launch
Fn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def bench(fn: Fn, ws: list[torch.Tensor], x: torch.Tensor) -> float:
    def run() -> None:
        for w in ws:
            fn(x, w)

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    for _ in range(3):
        g.replay()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(20):
        g.replay()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / 20 / len(ws)  # ms per call


def with_reduce(cfg: Config) -> Fn:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        p = kernel_only(cfg)(x, w)
        return (p[0] if p.shape[0] == 1 else p.sum(0)).to(x.dtype)

    return fn


def kernel_only(cfg: Config) -> Fn:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return tlin.skinny_partials(
            x, w, cfg.split_k, block_n=cfg.block_n, block_k=cfg.block_k,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip

    return fn


def valid(cfg: Config, m: int, k: int) -> bool:
    blocks = -(-k // cfg.block_k)
    smem = cfg.num_stages * (cfg.block_n + tlin.block_m(m)) * cfg.block_k * 2
    return cfg.split_k <= blocks and smem <= SMEM


def fmt(cfg: Config) -> str:
    return f"bn{cfg.block_n} bk{cfg.block_k} s{cfg.split_k} w{cfg.num_warps} st{cfg.num_stages}"


def rate(ms: float, n: int, k: int) -> str:
    return f"{ms * 1e3:7.1f} us {n * k * 2 / ms / 1e9:5.2f} TB/s"


def sweep(ws: list[torch.Tensor], x: torch.Tensor, start: Config, times: dict[Config, tuple[float, float]]) -> None:
    """Fills times[config] = (us with the reduce, us of the kernel alone),
    descending once by each (they part where the reduce is a kernel of its own)."""
    m, k = x.shape[0], ws[0].shape[1]

    def measure(cfgs: list[Config], by: int) -> Config:
        for cfg in cfgs:
            if cfg in times or not valid(cfg, m, k):
                continue
            try:
                times[cfg] = (bench(with_reduce(cfg), ws, x), bench(kernel_only(cfg), ws, x))
            except Exception as e:  # out of resources and the like: a config that cannot run
                print(f"      {fmt(cfg)}: {type(e).__name__}: {str(e).splitlines()[0][:100]}", flush=True)
                times[cfg] = (float("inf"), float("inf"))
        return min(times, key=lambda c: times[c][by])

    def shape_axes(base: Config) -> list[Config]:
        return [replace(base, block_n=bn, split_k=s) for bn, s in itertools.product((32, 64, 128), (1, 2, 4, 8))]

    for by in (0, 1):
        best = measure([start, *shape_axes(replace(start, block_k=128, num_warps=4, num_stages=4))], by)
        axes = itertools.product((64, 128, 256), (4, 8), (3, 4, 5))
        best = measure([replace(best, block_k=bk, num_warps=nw, num_stages=st) for bk, nw, st in axes], by)
        measure(shape_axes(best), by)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="shapes whose 'model name' contains this (e.g. 2b, gate_up)")
    parser.add_argument("--ms", default="1,8,32", help="batch sizes, comma-separated")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--budget", type=float, default=240, help="seconds; past it, no more sweeping")
    args = parser.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"{torch.cuda.get_device_name(dev)}, {sms} SMs, torch {torch.__version__}", flush=True)
    t0 = time.time()
    summary = []
    for model, name, n, k in SHAPES:
        if args.only and args.only not in f"{model} {name}":
            continue
        count = 1 if name == "lm_head" else 28
        gen = torch.Generator(device=dev).manual_seed(0)
        weights = torch.randn(count, n, k, device=dev, dtype=torch.bfloat16, generator=gen) * k**-0.5
        ws = list(weights.unbind(0))
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen)
            heur = tlin.choose(n, k, sms)
            got, want = tlin.skinny_linear(x, ws[0]), F.linear(x, ws[0])
            exact = F.linear(x.float(), ws[0].float())
            err, err_exact = float((got - want).abs().max()), float((got.float() - exact).abs().max())
            cublas_err = float((want.float() - exact).abs().max())
            t_cublas = bench(F.linear, ws, x)
            t_heur = bench(tlin.skinny_linear, ws, x)
            t_kernel = bench(kernel_only(heur), ws, x)
            print(
                f"{model} {name:8s} N={n:6d} K={k:5d} M={m:2d}  cuBLAS {rate(t_cublas, n, k)} | "
                f"heuristic [{fmt(heur)}] {rate(t_heur, n, k)} (kernel {rate(t_kernel, n, k)}) | "
                f"max|err| vs F.linear {err:.3g}, vs fp32 {err_exact:.3g} (cuBLAS's {cublas_err:.3g})",
                flush=True,
            )
            line: tuple[Any, ...] = (model, name, m, t_cublas, heur, t_heur, t_kernel, None, None)
            if not args.no_sweep and time.time() - t0 < args.budget:
                times: dict[Config, tuple[float, float]] = {heur: (t_heur, t_kernel)}
                sweep(ws, x, heur, times)
                picks = []
                for by, what in ((0, "with reduce"), (1, "kernel alone")):
                    ranked = sorted(times, key=lambda c, by=by: times[c][by])  # type: ignore[misc]
                    top = ", ".join(f"{fmt(c)} {times[c][by] * 1e3:.1f}" for c in ranked[1:4])
                    print(
                        f"    best {what} of {len(times)}: [{fmt(ranked[0])}] {rate(times[ranked[0]][by], n, k)}"
                        f"   next: {top}",
                        flush=True,
                    )
                    picks.append((ranked[0], times[ranked[0]][by]))
                line = (model, name, m, t_cublas, heur, t_heur, t_kernel, picks[0], picks[1])
            elif not args.no_sweep:
                print("    (past --budget: not swept)", flush=True)
            summary.append((*line, n, k))
        del ws, weights
        torch.cuda.empty_cache()

    print(f"\nsummary ({time.time() - t0:.0f} s): us/call, TB/s; +reduce: Triton with the partials' sum and cast")
    for model, name, m, t_cublas, heur, t_heur, t_kernel, best_r, best_k, n, k in summary:
        head = f"{model} {name:8s} M={m:2d} cuBLAS {rate(t_cublas, n, k)}"
        tail = f" | heuristic [{fmt(heur)}] +reduce {rate(t_heur, n, k)}, kernel {rate(t_kernel, n, k)}"
        if best_r is not None:
            tail += f" | best +reduce [{fmt(best_r[0])}] {rate(best_r[1], n, k)}"
            tail += f" | best kernel [{fmt(best_k[0])}] {rate(best_k[1], n, k)}"
        print(head + tail)


if __name__ == "__main__":
    main()
