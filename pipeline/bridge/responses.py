"""OpenAI-shaped response bodies and error objects."""

from __future__ import annotations

from typing import Any

import msgspec
import pybase64
from aiohttp import web

from schemas.chunk import ErrorChunk, ImageChunk, PromptLogprobs, TokenChunk, TokenLogprob, Usage
from schemas.errors import MmpipeError

_json = msgspec.json.Encoder()


def _error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_body(code: str, message: str, status: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": _error_type(status), "param": None, "code": code}}


def _error_response(code: str, message: str, status: int, retry_after_s: int) -> web.Response:
    headers = {"Retry-After": str(retry_after_s)} if status in (429, 503) else None
    return web.json_response(error_body(code, message, status), status=status, headers=headers)


def error(exc: MmpipeError, retry_after_s: int) -> web.Response:
    return _error_response(exc.code.value, exc.message, exc.http_status, retry_after_s)


def error_chunk(chunk: ErrorChunk, retry_after_s: int) -> web.Response:
    return _error_response(chunk.code.value, chunk.message, chunk.http_status, retry_after_s)


def error_body_from_chunk(chunk: ErrorChunk) -> dict[str, Any]:
    return error_body(chunk.code.value, chunk.message, chunk.http_status)


def sse(body: dict[str, Any]) -> bytes:
    return b"data: " + _json.encode(body) + b"\n\n"


def _usage(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        # OpenAI's field, as vLLM fills it: prompt tokens served from the prefix cache.
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


class Reply(msgspec.Struct, frozen=True):
    """How a request's answer is written: a chat completion's or a text
    completion's (/v1/completions) objects; the usage chunk at the end of a
    stream; a text completion's echoed prompts before their choices' text;
    ``n`` choices a prompt."""

    chat: bool = True
    include_usage: bool = False
    # Each prompt's echo (a text completion's ``echo``), by prompt.
    echoes: tuple[str, ...] = ()
    # vLLM's stream_options.continuous_usage_stats (with include_usage): usage so far on every chunk.
    continuous_usage: bool = False
    n: int = 1
    # An image after the text (a route with an image stage): the answer's
    # last part, in the message's content (streamed: the last chunk's delta).
    images: bool = False

    def echo(self, index: int) -> str:
        """What goes before choice ``index``'s text."""
        return self.echoes[index // self.n] if self.echoes else ""

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"


def stream_chunk(
    rid: str,
    model: str,
    created: int,
    chunk: TokenChunk,
    first: bool,
    reply: Reply,
    prompt: Usage | None = None,
    index: int = 0,
    offset: int = 0,
) -> dict[str, Any]:
    """One SSE chunk of choice ``index``; with ``reply.continuous_usage``,
    that choice's usage up to it (``prompt``: its first chunk's usage, the
    prompt's size). ``offset``: where a text completion's chunk starts in
    its choice's text (its tokens' ``text_offset``)."""
    finish = chunk.finish_reason.value if chunk.finish_reason else None
    if reply.chat:
        delta: dict[str, Any] = {"content": chunk.text}
        if first:
            delta["role"] = "assistant"
        logprobs = chat_logprobs(chunk.logprobs) if chunk.logprobs is not None else None
        choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
    else:
        text = reply.echo(index) + chunk.text if first else chunk.text
        logprobs = text_logprobs(chunk.logprobs, offset, chunk.prompt_logprobs) if chunk.logprobs is not None else None
        choice = {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}
    body = {"id": rid, "object": reply.chunk_object, "created": created, "model": model, "choices": [choice]}
    if reply.continuous_usage and prompt is not None:
        body["usage"] = _usage(Usage(prompt.prompt_tokens, chunk.end, prompt.cached_tokens))
    return body


def usage_chunk(rid: str, model: str, created: int, usage: Usage, reply: Reply) -> dict[str, Any]:
    return {
        "id": rid,
        "object": reply.chunk_object,
        "created": created,
        "model": model,
        "choices": [],
        "usage": _usage(usage),
    }


class Answer(msgspec.Struct):
    """One choice, whole: its text, its last chunk, its tokens' logprobs (if asked for)."""

    text: str
    last: TokenChunk
    logprobs: list[TokenLogprob] | None = None
    # An echoed prompt's (a text completion's ``echo`` with ``logprobs``).
    prompt_logprobs: PromptLogprobs | None = None
    # The images drawn after the text (an image stage's), in order.
    images: list[ImageChunk] = []


def image_part(image: ImageChunk) -> dict[str, Any]:
    """An image in a chat message's content, as a data: URL (as Dynamo's Omni handler writes it)."""
    url = f"data:{image.media_type};base64,{pybase64.b64encode_as_string(image.data)}"
    return {"type": "image_url", "image_url": {"url": url}}


def image_chunk(
    rid: str, model: str, created: int, images: list[ImageChunk], finish: str | None, index: int = 0
) -> dict[str, Any]:
    """The stream's last chunk of a choice with images: them in its delta, and the text's finish reason."""
    delta = {"content": [image_part(image) for image in sorted(images, key=lambda i: i.index)]}
    choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}


def completion(rid: str, model: str, created: int, answers: list[Answer], reply: Reply) -> dict[str, Any]:
    """The whole answer: each choice, by index."""
    choices = []
    for index, answer in enumerate(answers):
        last, lps = answer.last, answer.logprobs
        finish = last.finish_reason.value if last.finish_reason else None
        if reply.chat:
            content: str | list[dict[str, Any]] = answer.text
            if answer.images:
                content = [{"type": "text", "text": answer.text}, *(image_part(i) for i in answer.images)]
            choice: dict[str, Any] = {"index": index, "message": {"role": "assistant", "content": content}}
            logprobs = chat_logprobs(lps) if lps is not None else None
        else:
            echo = reply.echo(index)
            choice = {"index": index, "text": echo + answer.text}
            logprobs = text_logprobs(lps, len(echo), answer.prompt_logprobs) if lps is not None else None
        choices.append({**choice, "finish_reason": finish, "logprobs": logprobs})
    usage = total_usage([answer.last.usage for answer in answers], reply.n)
    return {
        "id": rid,
        "object": "chat.completion" if reply.chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": _usage(usage) if usage else None,
    }


def chat_logprobs(logprobs: list[TokenLogprob]) -> dict[str, Any]:
    """A chat choice's ``logprobs``: each token with its bytes and its step's most likely tokens."""
    return {
        "content": [
            {
                **_token(t.token, t.logprob),
                "top_logprobs": [_token(top.token, top.logprob) for top in t.top],
            }
            for t in logprobs
        ]
    }


def _token(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def text_logprobs(logprobs: list[TokenLogprob], offset: int, prompt: PromptLogprobs | None = None) -> dict[str, Any]:
    """A text completion's ``logprobs`` (the legacy shape): tokens, their
    logprobs, each step's most likely tokens by text, and where each token
    starts in the choice's text (from ``offset``). With the echoed
    ``prompt``'s, its tokens come first, from 0 (the first with no logprob:
    nothing comes before it), as vLLM writes them."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    if prompt is not None:
        offset = 0
        tokens.append(prompt.first)
        values.append(None)
        tops.append(None)
    for t in [*(prompt.tokens if prompt is not None else []), *logprobs]:
        tokens.append(t.token)
        values.append(t.logprob)
        tops.append({top.token: top.logprob for top in t.top})
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def logprobs_text_end(chunk: TokenChunk, offset: int) -> int:
    """Where the text of a chunk's logprob tokens ends in its choice's text
    (``offset``: where it starts; an echoed prompt's logprobs start it again from 0)."""
    if chunk.prompt_logprobs is not None:
        offset = len(chunk.prompt_logprobs.first) + sum(len(t.token) for t in chunk.prompt_logprobs.tokens)
    return offset + sum(len(t.token) for t in chunk.logprobs or [])


def total_usage(usages: list[Usage | None], n: int) -> Usage | None:
    """A request's usage over its choices (each choice's final usage, by
    index; ``n`` a prompt): each prompt counted once, as vLLM counts it, and
    every choice's completion tokens."""
    if not usages or any(u is None for u in usages):
        return None
    counted = [u for u in usages if u is not None]
    prompts = counted[::n]
    return Usage(
        prompt_tokens=sum(u.prompt_tokens for u in prompts),
        completion_tokens=sum(u.completion_tokens for u in counted),
        cached_tokens=sum(u.cached_tokens for u in prompts),
    )


def model_list(names: list[str], adapters: dict[str, str] | None = None) -> dict[str, Any]:
    """The served models, then the LoRA adapters on the first (vLLM lists
    each with its ``parent`` model and its directory as ``root``)."""
    data = [{"id": name, "object": "model", "created": 0, "owned_by": "mmpipe"} for name in names]
    if names and adapters:
        data += [
            {"id": name, "object": "model", "created": 0, "owned_by": "mmpipe", "root": path, "parent": names[0]}
            for name, path in sorted(adapters.items())
        ]
    return {"object": "list", "data": data}
