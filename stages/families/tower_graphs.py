"""Vision tower calls replayed from CUDA graphs, one per input shape.

A tower's forward is a few hundred small kernels, each preceded by Python:
the 2B preset's Qwen2-VL tower took 25 ms of host time for one 448×448
image on an H100 whose kernels ran 7 (2026-11-27). A graph replays the
launches without the Python. Shapes are the images' patch grids, so a graph
serves one grid (or one list of grids, an --encode-batch call): it is
captured the second time a grid comes (a one-off size costs no capture),
and the least recently used go past ``capacity``.

A capture that fails (a model whose forward reads a value back from the
GPU) turns graphs off for the tower: it runs eagerly from then on.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import structlog
import torch

from stages import cuda_graph

log = structlog.get_logger(__name__)

Tower = Callable[..., torch.Tensor]


class TowerGraphs:
    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self.enabled = capacity > 0
        self._seen: set[Hashable] = set()
        # key → (graph, static inputs, static output)
        self._graphs: OrderedDict[Hashable, tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor], torch.Tensor]] = (
            OrderedDict()
        )
        self._pool: Any = None  # the first graph's memory pool handle

    def __len__(self) -> int:
        return len(self._graphs)

    def __call__(self, key: Hashable, tower: Tower, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """``tower(**inputs)``, from the graph of ``key`` (its shapes and
        constants) where one is or can now be captured. The result is the
        caller's own (a copy of the graph's output)."""
        if not self.enabled or not all(t.is_cuda for t in inputs.values()):
            return tower(**inputs)
        entry = self._graphs.get(key)
        if entry is None:
            if key not in self._seen:
                self._seen.add(key)
                return tower(**inputs)
            entry = self._capture(key, tower, inputs)
            if entry is None:
                return tower(**inputs)
        self._graphs.move_to_end(key)
        graph, static, out = entry
        for name, tensor in inputs.items():
            static[name].copy_(tensor)
        graph.replay()
        return out.clone()

    def _capture(
        self, key: Hashable, tower: Tower, inputs: dict[str, torch.Tensor]
    ) -> tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor], torch.Tensor] | None:
        static = {name: t.clone() for name, t in inputs.items()}
        try:
            # One memory pool for every graph: replays run one at a time on
            # one stream, and each output is copied out before the next.
            graph, out = cuda_graph.capture(lambda: tower(**static), warmups=1, pool=self._pool)
        except Exception as exc:
            self.enabled = False
            self._graphs.clear()
            log.warning("tower_graphs_off", error=repr(exc))
            return None
        self._pool = graph.pool()
        self._graphs[key] = (graph, static, out)
        while len(self._graphs) > self.capacity:
            self._graphs.popitem(last=False)
        return self._graphs[key]
