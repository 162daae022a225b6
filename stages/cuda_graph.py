"""Capturing a CUDA graph the way every graph here is captured."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def capture(forward: Callable[[], T], warmups: int, pool: Any = None) -> tuple[torch.cuda.CUDAGraph, T]:
    """``forward`` run ``warmups`` times on a side stream (allocations,
    autotuning, compilation), then captured; returns the graph and its
    static output. ``pool``: another graph's memory pool to share, for
    graphs replayed one at a time on one stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()
    return graph, out
