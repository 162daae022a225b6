"""What a stage is, as the worker runtime sees it. No NATS here: a stage is
an async generator from one input Struct to output Structs, testable alone."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from opentelemetry import trace as otel_trace

from schemas.chunk import ImageChunk, TokenChunk
from schemas.processed import ProcessedRequest
from schemas.request import GenerateRequest
from schemas.tensors import TensorRef

if TYPE_CHECKING:
    import torch

StageInput = GenerateRequest | ProcessedRequest
# A ProcessedRequest goes to the next hop of its route; TokenChunks and
# ImageChunks go to the request's reply subject.
StageOutput = ProcessedRequest | TokenChunk | ImageChunk


@dataclass
class HopContext:
    # Tokens an earlier attempt already streamed to the client (read back from
    # the reply stream on a takeover): generation resumes after them.
    emitted: list[int] = field(default_factory=list)
    # This hop's message came again (its first worker died or let it lapse):
    # what that run started elsewhere (an engine's KV hand-off) may be gone.
    redelivered: bool = False
    # What the stage did, for the request's trace line: tensor bytes and
    # seconds moved in and out, step times.
    trace: dict[str, float] = field(default_factory=dict)
    # Where the steps run in a process that exports no spans (the engine
    # core): each step's name, wall-clock start and end (ns) and attributes,
    # for the process that exports to make its spans.
    steps: list[StepTime] | None = None

    @contextmanager
    def timed(self, step: str, **attributes: Any) -> Iterator[otel_trace.Span]:
        """A step of the hop: its seconds on the hop's trace line
        (``<step>_s``) and a span in the request's trace (a no-op span when
        tracing is off). Not across a generator's yield: the span is current
        inside the block."""
        started, started_ns = time.monotonic(), time.time_ns()
        try:
            with _TRACER.start_as_current_span(step, attributes=attributes) as span:
                yield span
        finally:
            self.trace[f"{step}_s"] = time.monotonic() - started
            if self.steps is not None:
                self.steps.append((step, started_ns, time.time_ns(), _plain(attributes)))


# A step timed in another process: name, start and end (wall clock, ns), attributes.
StepTime = tuple[str, int, int, dict[str, str | int | float | bool]]


def _plain(attributes: dict[str, Any]) -> dict[str, str | int | float | bool]:
    return {k: v for k, v in attributes.items() if isinstance(v, str | int | float | bool)}


def replay_steps(steps: list[StepTime]) -> None:
    """Spans, under the current one, for steps timed in another process
    (a host's processes share its wall clock)."""
    for name, start_ns, end_ns, attributes in steps:
        span = _TRACER.start_span(name, start_time=start_ns, attributes=attributes)
        span.end(end_time=end_ns)


# The runtime sets the provider (pipeline/tracing.py) before any span starts.
_TRACER = otel_trace.get_tracer("mmpipe")


def step_span(step: str) -> otel_trace.Span:
    """A span the caller ends itself, for a step that ends in a generator (the first decode step)."""
    return _TRACER.start_span(step)


class TensorStore(Protocol):
    """How a stage hands tensors to the next hop without putting them in a
    message; the worker runtime supplies one (NIXL, or a fallback)."""

    async def put(self, tensors: list[torch.Tensor], *, owner: str) -> TensorRef: ...

    async def get(self, ref: TensorRef, device: torch.device | str = "cpu") -> list[torch.Tensor]: ...

    # A target: one tensor (views allowed), or its pieces along the first dimension, in order.
    async def get_into(self, ref: TensorRef, targets: list[torch.Tensor | list[torch.Tensor]]) -> None: ...

    async def release(self, ref: TensorRef) -> None: ...


class Stage(Protocol):
    role: str
    # True when the stage continues a token stream a client may already hold
    # part of: the runtime reads what was emitted before it runs.
    resumes_stream: bool

    @property
    def input_type(self) -> type[GenerateRequest] | type[ProcessedRequest]: ...

    @property
    def models(self) -> list[str]: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def has_room(self) -> bool:
        """Whether the worker may fetch another message: False holds it back
        (back-pressure, never an error) until the stage has room again."""
        ...

    def run(self, message: StageInput, ctx: HopContext) -> AsyncGenerator[StageOutput, None]: ...
