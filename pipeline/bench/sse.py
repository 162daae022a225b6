"""A bare streaming chat client for ``mmpipe bench --client aiohttp``: one
POST, the server-sent events read line by line, each chunk's JSON decoded
by msgspec, nothing else. The openai client builds a pydantic model per
chunk: on a small machine that costs about a millisecond of the time to
the first token (2 vCPUs, 2026-11-29), the client's, not the server's.
vLLM's own serving benchmark drives servers with aiohttp the same way."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec


class StreamError(Exception):
    """The server answered other than with a stream of chunks."""


@dataclass(frozen=True)
class StreamEvent:
    """What the bench reads of one chunk: whether it has a choice, its
    finish reason, and the usage (completion, prompt, cached tokens) where
    the chunk carries it."""

    choice: bool
    finish_reason: str | None = None
    usage: tuple[int, int, int] | None = None
    # The first choice's new text (a conversation goes on with it).
    text: str = ""


def choice_event(choices: Sequence[Any], usage: tuple[int, int, int] | None) -> StreamEvent:
    """A chunk's event from its choices, as either client decodes them (each
    choice with ``finish_reason`` and a ``delta`` with ``content``)."""
    first = choices[0] if choices else None
    if first is None:
        return StreamEvent(False, None, usage)
    text = (first.delta.content or "") if first.delta is not None else ""
    return StreamEvent(True, first.finish_reason, usage, text)


class _Usage(msgspec.Struct):
    completion_tokens: int = 0
    prompt_tokens: int = 0
    prompt_tokens_details: dict[str, Any] | None = None


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    finish_reason: str | None = None
    delta: _Delta | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None


_DECODER = msgspec.json.Decoder(_Chunk)


class SseChat:
    """Streamed chat completions over one aiohttp session (``close`` it)."""

    def __init__(self, base_url: str, api_key: str | None, timeout_s: float) -> None:
        self._url = base_url.rstrip("/") + "/chat/completions"
        self._headers = {"Authorization": f"Bearer {api_key or 'none'}"}
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s))

    async def close(self) -> None:
        await self._session.close()

    async def stream(self, body: dict[str, Any], headers: dict[str, str] | None = None) -> AsyncIterator[StreamEvent]:
        async with self._session.post(
            self._url, json={**body, "stream": True}, headers=self._headers | (headers or {})
        ) as r:
            if r.status != 200:
                raise StreamError(f"HTTP {r.status}: {(await r.text())[:300]}")
            async for line in r.content:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                chunk = _DECODER.decode(data)
                if chunk.usage is None and not chunk.choices and b'"error"' in data:
                    raise StreamError(json.loads(data).get("error", {}).get("message", "an error chunk"))
                usage = None
                if chunk.usage is not None:
                    details = chunk.usage.prompt_tokens_details or {}
                    usage = (
                        chunk.usage.completion_tokens,
                        chunk.usage.prompt_tokens,
                        int(details.get("cached_tokens") or 0),
                    )
                yield choice_event(chunk.choices, usage)
