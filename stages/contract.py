"""What a stage is, as the worker runtime sees it. No NATS here: a stage is
an async generator from one input Struct to output Structs, testable alone."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Protocol

from schemas.chunk import TokenChunk
from schemas.processed import ProcessedRequest
from schemas.request import GenerateRequest

StageInput = GenerateRequest | ProcessedRequest
# A ProcessedRequest goes to the next hop of its route; TokenChunks go to the
# request's reply subject.
StageOutput = ProcessedRequest | TokenChunk


@dataclass
class HopContext:
    # Tokens an earlier attempt already streamed to the client (read back from
    # the reply stream on a takeover): generation resumes after them.
    emitted: list[int] = field(default_factory=list)


class Stage(Protocol):
    role: str
    # True when the stage streams tokens (it runs the decode step).
    streams_tokens: bool

    @property
    def input_type(self) -> type[GenerateRequest] | type[ProcessedRequest]: ...

    @property
    def models(self) -> list[str]: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def run(self, message: StageInput, ctx: HopContext) -> AsyncGenerator[StageOutput, None]: ...
