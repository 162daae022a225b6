"""The chaos run's client: one streamed chat completion over plain HTTP,
recorded chunk by chunk (what the client saw, and when)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

# Codes that mean "not taken": the request never reached a queue.
NOT_ACCEPTED = {429, 503}


@dataclass(frozen=True)
class Job:
    """One request of a run: which picture, which words, how to sample."""

    index: int
    # Which of the run's distinct requests this is (picture, words, sampling):
    # requests with the same variant must get the same answer.
    variant: int
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None

    @property
    def image(self) -> int:
        return self.variant % 4

    @property
    def prompt(self) -> str:
        return f"Describe picture {self.image}, take {self.variant}."


@dataclass
class Result:
    job: Job
    status: int = 0
    code: str = ""
    retry_after: str | None = None
    # Seconds from sending to the status line, and the bridge's own time (Server-Timing).
    answer_s: float = 0.0
    bridge_ms: float | None = None
    request_id: str | None = None
    # One entry per SSE chunk that carried a choice: its text, and when (monotonic).
    texts: list[str] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    finish: str | None = None
    done: bool = False
    error: str = ""
    started: float = 0.0
    ended: float = 0.0

    @property
    def accepted(self) -> bool:
        return self.status not in NOT_ACCEPTED and self.status != 0

    @property
    def completed(self) -> bool:
        return self.status == 200 and self.done and self.finish is not None and not self.error

    @property
    def text(self) -> str:
        return "".join(self.texts)


def picture(index: int, size: int = 32) -> Any:
    from PIL import Image

    image = Image.new("RGB", (size, size))
    image.putdata([((x * 7 + index * 31) % 256, (y * 5 + index * 17) % 256, (x * y + index) % 256)
                   for y in range(size) for x in range(size)])  # fmt: skip
    return image


def image_url(index: int) -> str:
    image = picture(index)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def content(job: Job) -> list[dict[str, Any]]:
    return [
        {"type": "image_url", "image_url": {"url": image_url(job.image)}},
        {"type": "text", "text": job.prompt},
    ]


def body(job: Job, model: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": content(job)}],
        "max_tokens": job.max_tokens,
        "min_tokens": job.max_tokens,
        "temperature": job.temperature,
        "stream": True,
    }
    if job.seed is not None:
        out["seed"] = job.seed
    return out


async def stream(
    session: aiohttp.ClientSession,
    url: str,
    job: Job,
    model: str,
    timeout_s: float = 120.0,
    result: Result | None = None,
) -> Result:
    """POST one streamed request and read it to its end (or the timeout);
    ``result`` (when given) fills in as chunks arrive, for a live view."""
    result = result or Result(job=job)
    result.started = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(f"{url}/v1/chat/completions", json=body(job, model)) as response:
                result.status = response.status
                result.answer_s = time.monotonic() - result.started
                result.retry_after = response.headers.get("Retry-After")
                result.request_id = response.headers.get("X-Request-Id")
                timing = response.headers.get("Server-Timing", "")
                if "dur=" in timing:
                    result.bridge_ms = float(timing.split("dur=", 1)[1].split(";")[0].split(",")[0])
                if response.status != 200:
                    try:
                        result.code = (await response.json())["error"]["code"]
                    except (aiohttp.ContentTypeError, KeyError, ValueError):
                        result.code = "?"
                    return result
                async for raw in response.content:
                    line = raw.strip()
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:]
                    if data == b"[DONE]":
                        result.done = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        result.error = chunk["error"].get("code") or "error"
                        continue
                    for choice in chunk.get("choices", []):
                        result.texts.append(choice["delta"].get("content") or "")
                        result.times.append(time.monotonic())
                        result.finish = choice.get("finish_reason") or result.finish
    except TimeoutError:
        result.error = "client_timeout"
    except aiohttp.ClientError as exc:
        result.error = f"connection: {type(exc).__name__}"
    finally:
        result.ended = time.monotonic()
    return result


def session(concurrency: int) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))
