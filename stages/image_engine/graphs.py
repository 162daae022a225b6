"""A diffusers pipeline's denoiser as CUDA graphs, one per input shape.

At one image a request the denoising loop is bound by the host, not the
GPU: Stable Diffusion 1.5's UNet launches on the order of a thousand
kernels a step, each a Python call through diffusers' modules, so a step
takes as long as the CPU needs to issue them (and longer while the
worker's other threads hold the GIL). Replayed from a graph a step costs
one launch. The scheduler's arithmetic between steps, the text encoder and
the VAE stay eager: a few kernels a step, and one call each a request.

A call the graph was not captured for (another shape, the extra inputs of
adapters or ControlNets, autograd) runs the UNet's own forward unchanged.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import structlog

log = structlog.get_logger(__name__)

# The UNet's optional inputs, which a Stable Diffusion pipeline passes as
# None when nothing beyond text-to-image is asked of it.
_OPTIONAL = frozenset(
    {
        "class_labels",
        "timestep_cond",
        "attention_mask",
        "cross_attention_kwargs",
        "added_cond_kwargs",
        "down_block_additional_residuals",
        "mid_block_additional_residual",
        "down_intrablock_additional_residuals",
        "encoder_attention_mask",
    }
)


class _Captured:
    """One shape's graph: its inputs are copied in, its output copied out."""

    def __init__(self, forward: Any, sample: Any, timestep: Any, context: Any, pool: Any) -> None:
        import torch

        self.sample, self.timestep, self.context = sample.clone(), timestep.clone(), context.clone()
        # Before capture, on a side stream as torch's graph recipe has it:
        # cuDNN's and cuBLAS's first calls pick algorithms and allocate
        # workspaces, which a capture must not record.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                forward(self.sample, self.timestep, self.context, return_dict=False)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: the worker's other threads (PNG writers, the NIXL
        # agent) may touch CUDA while the drawing thread captures.
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            self.out = forward(self.sample, self.timestep, self.context, return_dict=False)[0]

    def __call__(self, sample: Any, timestep: Any, context: Any) -> Any:
        self.sample.copy_(sample)
        self.timestep.copy_(timestep)
        self.context.copy_(context)
        self.graph.replay()
        # A copy: the next replay, of this graph or another in the same
        # pool, writes over the captured output.
        return self.out.clone()


class GraphedDenoiser:
    """``unet.forward`` through CUDA graphs captured on first use of each
    shape (at most ``max_graphs`` kept, the least recently used let go)."""

    def __init__(self, unet: Any, max_graphs: int = 8) -> None:
        self.unet = unet
        self.eager = unet.forward
        self.max_graphs = max_graphs
        self.graphs: OrderedDict[tuple[Any, ...], _Captured] = OrderedDict()
        # One memory pool for every shape's graph (made at the first
        # capture): they run one at a time (one drawing thread), and each
        # output is copied before the next.
        self.pool: Any = None
        self.captures = 0
        # A capture that failed (an op that cannot be captured, in a
        # pipeline this was not written for): every call eager from then on.
        self.broken = False

    def install(self) -> None:
        """Route the module's calls through the graphs (an attribute on the
        instance, which ``nn.Module.__call__`` finds before the class's)."""
        self.unet.forward = self

    def uninstall(self) -> None:
        self.unet.__dict__.pop("forward", None)
        self.graphs.clear()

    def __call__(self, sample: Any, timestep: Any, encoder_hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
        import torch

        return_dict = kwargs.pop("return_dict", True)
        plain = (
            not args
            and kwargs.keys() <= _OPTIONAL
            and all(value is None for value in kwargs.values())
            and isinstance(timestep, torch.Tensor)
            and timestep.ndim == 0
            and timestep.device == sample.device
            and sample.is_cuda
            and encoder_hidden_states.device == sample.device
            and not torch.is_grad_enabled()
            and not self.broken
        )
        if not plain:
            return self.eager(sample, timestep, encoder_hidden_states, *args, return_dict=return_dict, **kwargs)
        key = (
            tuple(sample.shape),
            sample.dtype,
            tuple(encoder_hidden_states.shape),
            encoder_hidden_states.dtype,
            timestep.dtype,
            sample.device,
        )
        captured = self.graphs.get(key)
        if captured is None:
            while len(self.graphs) >= self.max_graphs:
                self.graphs.popitem(last=False)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            try:
                captured = _Captured(self.eager, sample, timestep, encoder_hidden_states, self.pool)
            except Exception as exc:  # the drawing goes on eagerly; the reason is logged once
                self.broken = True
                log.warning("image denoiser graphs off: capture failed", error=repr(exc), shape=list(sample.shape))
                return self.eager(sample, timestep, encoder_hidden_states, return_dict=return_dict, **kwargs)
            self.graphs[key] = captured
            self.captures += 1
            log.info("image denoiser graph captured", shape=list(sample.shape), graphs=len(self.graphs))
        else:
            self.graphs.move_to_end(key)
        out = captured(sample, timestep, encoder_hidden_states)
        if return_dict:
            from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput

            return UNet2DConditionOutput(sample=out)
        return (out,)
