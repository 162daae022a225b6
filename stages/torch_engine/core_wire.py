"""The messages between a worker and its engine core process
(``--engine-process``): msgspec Structs, msgpack, each frame a 4-byte
length and one message.

The worker asks at the level of a hop's steps (encode, prefill, decode,
abort), not of engine calls: a request costs a handful of messages, and the
decode loop runs in the core without a word from the worker between steps.
A call's id names its reply (or, for a decode, its tokens and its end).
"""

from __future__ import annotations

import asyncio

import msgspec

from schemas.processed import ProcessedRequest
from stages.sampling import Logprobs

# -- worker → core -------------------------------------------------------------


class Encode(msgspec.Struct, tag=True, array_like=True):
    call: int
    req: ProcessedRequest


class Prefill(msgspec.Struct, tag=True, array_like=True):
    call: int
    req: ProcessedRequest
    # An ``Encoded.media`` (0: a request without media).
    media: int
    emitted: list[int]


class Decode(msgspec.Struct, tag=True, array_like=True):
    call: int
    seq: int
    req: ProcessedRequest
    emitted: list[int]


class Cancel(msgspec.Struct, tag=True, array_like=True):
    """The worker no longer waits for the call (its request was cancelled,
    or its consumer stopped reading tokens)."""

    call: int


class Abort(msgspec.Struct, tag=True, array_like=True):
    """The hop is done with a prefilled sequence: what the core holds for it goes."""

    seq: int


class DropMedia(msgspec.Struct, tag=True, array_like=True):
    """Embeddings no prefill will take (the request failed between the two)."""

    media: int


class Scrape(msgspec.Struct, tag=True, array_like=True):
    call: int


class ResetCache(msgspec.Struct, tag=True, array_like=True):
    call: int


class LoadLora(msgspec.Struct, tag=True, array_like=True):
    """Load a LoRA adapter (PEFT's directory) for requests that name it."""

    call: int
    name: str
    path: str


class UnloadLora(msgspec.Struct, tag=True, array_like=True):
    call: int
    name: str


class Sleep(msgspec.Struct, tag=True, array_like=True):
    """The engine's sleep mode at ``level`` (1: KV cache freed, weights to host memory; 2: weights dropped)."""

    call: int
    level: int


class WakeUp(msgspec.Struct, tag=True, array_like=True):
    call: int


class Canary(msgspec.Struct, tag=True, array_like=True):
    """A tiny request through the core's engine (the worker's canary health check)."""

    call: int


# The engine's operations beside serving: each answered with ``Done``.
Operation = LoadLora | UnloadLora | Sleep | WakeUp | Canary

ToCore = Encode | Prefill | Decode | Cancel | Abort | DropMedia | Scrape | ResetCache | Operation

# -- core → worker -------------------------------------------------------------


class Ready(msgspec.Struct, tag=True, array_like=True):
    pid: int
    eos_token_ids: list[int]
    max_model_len: int
    device: str
    # The engine's device bytes by what holds them (weights, kv_cache).
    held: dict[str, int] = {}


class StartFailed(msgspec.Struct, tag=True, array_like=True):
    error: str


class EmbeddingInfo(msgspec.Struct, array_like=True):
    """One encoded item as the worker sees it: its size and layout, not its tensor."""

    num_tokens: int
    grid: list[int]
    kind: str
    seconds_per_grid: float


# A step the core timed (HopContext.steps): the worker makes it a span.
Step = tuple[str, int, int, dict[str, str | int | float | bool]]


class Encoded(msgspec.Struct, tag=True, array_like=True):
    call: int
    media: int
    items: list[EmbeddingInfo]
    trace: dict[str, float]
    steps: list[Step]


class Prefilled(msgspec.Struct, tag=True, array_like=True):
    call: int
    seq: int
    prompt_len: int
    output_ids: list[int]
    trace: dict[str, float]
    steps: list[Step]
    cached_tokens: int = 0
    # Where the request asked for them, its prompt's logprobs (its tokens' come with them).
    prompt_logprobs: list[Logprobs] | None = None


class Tokens(msgspec.Struct, tag=True, array_like=True):
    """What the decode loop made since the last frame: each open decode
    call's tokens, in order (one frame for every stream a step fed), and
    for a call whose request asked for logprobs, those of its tokens, by
    index among the generated tokens."""

    streams: list[tuple[int, list[int]]]
    logprobs: dict[int, dict[int, Logprobs]] = {}


class Finished(msgspec.Struct, tag=True, array_like=True):
    """A decode call's stream ended (its last token was in an earlier ``Tokens``)."""

    call: int


class Failed(msgspec.Struct, tag=True, array_like=True):
    call: int
    # The class's name: one of schemas.errors keeps its code and status.
    error: str
    message: str


class Room(msgspec.Struct, tag=True, array_like=True):
    """Whether the core would take another request (sent when it changes)."""

    has_room: bool


class Broken(msgspec.Struct, tag=True, array_like=True):
    """The core can serve no more (its decode loop stopped)."""

    reason: str


class Scraped(msgspec.Struct, tag=True, array_like=True):
    call: int
    text: bytes


class CacheReset(msgspec.Struct, tag=True, array_like=True):
    call: int
    # None: the core's engine holds no KV pool.
    blocks: int | None


class Done(msgspec.Struct, tag=True, array_like=True):
    """An ``Operation`` done: what it gave (a sleep: the bytes held before)
    and the engine as it is after (its bytes held, its adapters)."""

    call: int
    held: dict[str, int]
    loras: list[str]
    result: dict[str, int] = {}


FromCore = (
    Ready | StartFailed | Encoded | Prefilled | Tokens | Finished | Failed | Room | Broken | Scraped | CacheReset | Done
)

# Frames past this are a bug, not a request (a ProcessedRequest with inline media stays far below).
MAX_FRAME = 1 << 30

_LENGTH = 4


def frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(_LENGTH, "big") + payload


async def read_frame(reader: asyncio.StreamReader) -> bytes | None:
    """The next frame's payload; None at the end of the stream."""
    try:
        head = await reader.readexactly(_LENGTH)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise ConnectionError("the engine core's stream ended inside a frame") from None
        return None
    size = int.from_bytes(head, "big")
    if size > MAX_FRAME:
        raise ConnectionError(f"a frame of {size} bytes from the engine core's peer")
    return await reader.readexactly(size)
