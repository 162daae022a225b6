"""What a stage is, as the worker runtime sees it. No NATS here: a stage is
an async generator from one input Struct to output Structs, testable alone."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from schemas.chunk import TokenChunk
from schemas.processed import ProcessedRequest
from schemas.request import GenerateRequest
from schemas.tensors import TensorRef

if TYPE_CHECKING:
    import torch

StageInput = GenerateRequest | ProcessedRequest
# A ProcessedRequest goes to the next hop of its route; TokenChunks go to the
# request's reply subject.
StageOutput = ProcessedRequest | TokenChunk


@dataclass
class HopContext:
    # Tokens an earlier attempt already streamed to the client (read back from
    # the reply stream on a takeover): generation resumes after them.
    emitted: list[int] = field(default_factory=list)
    # What the stage did, for the request's trace line: tensor bytes and
    # seconds moved in and out, step times.
    trace: dict[str, float] = field(default_factory=dict)


class TensorStore(Protocol):
    """How a stage hands tensors to the next hop without putting them in a
    message; the worker runtime supplies one (NIXL, or a fallback)."""

    async def put(self, tensors: list[torch.Tensor], *, owner: str) -> TensorRef: ...

    async def get(self, ref: TensorRef, device: torch.device | str = "cpu") -> list[torch.Tensor]: ...

    async def get_into(self, ref: TensorRef, targets: list[torch.Tensor]) -> None: ...

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

    def run(self, message: StageInput, ctx: HopContext) -> AsyncGenerator[StageOutput, None]: ...
