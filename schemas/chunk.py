"""What flows back on a reply subject: token chunks, then one final chunk or an error."""

from __future__ import annotations

import enum

import msgspec

from schemas.errors import ErrorCode, MmpipeError
from schemas.tensors import TensorRef


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"


class Usage(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    prompt_tokens: int
    completion_tokens: int
    # Of the prompt tokens, those whose KV blocks came from the prefix cache.
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class TopLogprob(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    token_id: int
    # The token as text alone (what OpenAI's ``token`` field shows).
    token: str
    logprob: float


class TokenLogprob(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """A generated token's log probability under the model's own output
    (before temperature, top-k and top-p: vLLM's default, raw logprobs), and
    the most likely tokens' at that step, best first (as many as asked)."""

    token_id: int
    token: str
    logprob: float
    top: list[TopLogprob] = []


class PromptLogprobs(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """An echoed prompt's logprobs (a completion's ``echo`` with ``logprobs``):
    its first token's text (nothing before it gives it a probability), then
    each later token's, as a generated token's are given."""

    first: str
    tokens: list[TokenLogprob]


class TokenChunk(msgspec.Struct, tag="token", tag_field="kind", omit_defaults=True, forbid_unknown_fields=True):
    request_id: str
    # Index of this chunk's first token among all generated tokens: a relay
    # drops any chunk whose seq it has already passed.
    seq: int
    token_ids: list[int]
    text: str = ""
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    # One for each of token_ids, where the request asked for logprobs.
    logprobs: list[TokenLogprob] | None = None
    # On the first chunk, where the request asked for the prompt's logprobs.
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def end(self) -> int:
        return self.seq + len(self.token_ids)


class ImageChunk(msgspec.Struct, tag="image", tag_field="kind", omit_defaults=True, forbid_unknown_fields=True):
    """One image an image-generation stage drew, encoded (``media_type``):
    the ``index``-th of the request's ``count``. Its bytes inline up to
    ``MAX_INLINE_IMAGE``, never more: a larger one is held by the worker
    for the bridge to read (``ref``: one uint8 tensor of the file's bytes)."""

    request_id: str
    index: int
    count: int
    data: bytes = b""
    ref: TensorRef | None = None
    media_type: str = "image/png"
    width: int = 0
    height: int = 0
    # The generator's seed: the same seed, prompt and size draw the same image.
    seed: int = 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


# The most bytes an image rides inline in a reply chunk.
MAX_INLINE_IMAGE = 1 << 20


class ErrorChunk(msgspec.Struct, tag="error", tag_field="kind", omit_defaults=True, forbid_unknown_fields=True):
    request_id: str
    code: ErrorCode
    message: str
    http_status: int
    retryable: bool = False

    @classmethod
    def from_error(cls, request_id: str, error: MmpipeError) -> ErrorChunk:
        return cls(
            request_id=request_id,
            code=error.code,
            message=error.message,
            http_status=error.http_status,
            retryable=error.retryable,
        )


ReplyChunk = TokenChunk | ImageChunk | ErrorChunk


def as_text(chunk: ReplyChunk) -> TokenChunk | ErrorChunk:
    """A chunk of a reply that has text only (a chat or text completion): an
    image there is a route's bug, told the client as an internal error."""
    if not isinstance(chunk, ImageChunk):
        return chunk
    return ErrorChunk(chunk.request_id, ErrorCode.INTERNAL, "an image in a text reply", http_status=500)
