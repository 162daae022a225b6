"""``mmpipe bench``: a fixed load on the bridge from the official openai client.

Why it is built this way:

- The official ``AsyncOpenAI`` client, streaming with usage, because that is
  what users run: the numbers include the bridge's SSE framing and the
  client's parsing, as a user's would.
- Closed loop: ``concurrency`` requests are in flight at once, each sender
  starting its next request when its last one ends, until ``requests`` are
  done. The numbers then describe a steady load, not a burst.
- Fixed output length: ``min_tokens == max_tokens`` and temperature 0, so
  every request produces exactly ``max_tokens`` tokens (the tiny model has
  random weights and would otherwise stop at a random EOS), and tokens/s
  compares like with like across runs and modes.
- Synthetic images are seeded random PNGs sent as ``data:`` URLs, made once
  before the clock starts: the same seed gives the same bytes on every run,
  random pixels defeat any compression shortcut, and nothing is fetched.
  Every request (the warm-up too) gets images of its own, so the encoding
  worker's embedding cache (keyed by content) never hits and every request
  pays for its encode.
- One warm-up request first, not counted: it pays for lazy initialisation
  (first NIXL connection between two workers, allocator growth).
- Failed requests are counted and their errors listed, never dropped from
  the report: a fast benchmark that failed half its requests is not fast.
- Several client processes under load (``processes``; by default one per 16
  streams, up to a quarter of the cores): the openai client parsing 64
  streams' SSE in one Python process was itself the wall (one core busy,
  the bridge and worker nearly idle, on an H100 host at about 32 req/s).
  Each reports the share of a core it used; one near a whole core says the
  numbers are the client's, not the server's.

TTFT is the time to the first chunk with a choice (the bridge sends one per
token, even when the detokenizer holds that token's text back); ITL is the
gap between consecutive such chunks, pooled over all requests; E2E is the
whole request, up to the end of the stream. Tokens are the usage chunk's
``completion_tokens``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import itertools
import json
import math
import multiprocessing
import os
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from pipeline.bench.results import figure
from pipeline.bench.sse import SseChat, StreamEvent, choice_event

if TYPE_CHECKING:
    import openai

PROMPT = "Describe the picture."
# Numbers the long prompts of --filler-words (with the process id: one a client process).
_DOCUMENTS = itertools.count()
PERCENTILES = (50, 90, 99)
# Streams one client process takes by default (64 in one were its whole core).
STREAMS_PER_PROCESS = 16
CLIENTS = ("openai", "aiohttp")
# A client process busier than this share of a core may be what the figures measure.
CLIENT_BUSY = 0.85


@dataclass(frozen=True)
class LoadSpec:
    url: str = "http://127.0.0.1:8000/v1"
    model: str = "tiny-qwen2-vl"
    concurrency: int = 8
    requests: int = 64
    max_tokens: int = 32
    image_size: tuple[int, int] = (224, 224)
    images_per_request: int = 1
    seed: int = 0
    api_key: str | None = None
    timeout_s: float = 300.0
    # Client processes (0: one per STREAMS_PER_PROCESS streams, up to a quarter of the cores).
    processes: int = 0
    # Words appended to the prompt (long-context loads): " the" each, one token in Qwen's vocabulary.
    filler_words: int = 0
    # Every other request asks to be traced (a W3C traceparent, sampled), the
    # rest not to be: tracing's cost within one stack, under one load.
    trace_alternate: bool = False
    # What sends the requests: the official openai client, or a bare aiohttp
    # reader of the server-sent events (as vLLM's serving benchmark does).
    client: str = "openai"
    # Instead of ``requests``, at every concurrency: this many per client.
    requests_per_client: int = 0
    # A second stack's base URL: every other request goes there, the rest to
    # ``url``, each side measured apart under one load (two trees or two
    # settings compared with the host's drift shared between them).
    compare_url: str = ""

    def __post_init__(self) -> None:
        if self.client not in CLIENTS:
            raise ValueError(f"client must be one of {', '.join(CLIENTS)}")
        for name in ("concurrency", "requests", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.processes < 0 or self.filler_words < 0 or self.requests_per_client < 0:
            raise ValueError("processes, filler_words and requests_per_client must not be negative")
        if self.images_per_request < 0:
            raise ValueError("images_per_request must not be negative")
        if min(self.image_size) < 1:
            raise ValueError("image_size must be at least 1x1")
        if self.compare_url and self.trace_alternate:
            raise ValueError("compare_url and trace_alternate both take every other request: one at a time")
        if self.compare_url and self.compare_url.rstrip("/") == self.url.rstrip("/"):
            raise ValueError("compare_url is url itself: name another stack's")


@dataclass
class RequestResult:
    ok: bool
    e2e_s: float
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    cached_tokens: int = 0
    # With trace_alternate: whether this request asked to be traced.
    traced: bool | None = None
    # When it ended, time.monotonic(): one clock for every process of the host.
    ended: float = 0.0
    # With compare_url: whether this request went there (else to url).
    compared: bool | None = None


def steady_rate(results: Sequence[RequestResult], concurrency: int) -> float | None:
    """Completed requests a second while every client had one in flight: from
    the ``concurrency``-th request to end to the (N − ``concurrency``)-th, after
    which the closed loop has nothing left to send and its clients go idle one
    by one. ``requests / wall`` counts that drain and the first wave's start,
    both as long as one request's latency, which grows with the clients: at
    the same request count, more clients weigh them more. None when the run
    has too few requests for such a window (fewer than 2 × concurrency + 2)."""
    ends = sorted(r.ended for r in results if r.ended)
    first, last = concurrency - 1, len(ends) - concurrency - 1
    if last - first < 2 or ends[last] <= ends[first]:
        return None
    inside = sum(1 for r in results if r.ok and ends[first] < r.ended <= ends[last])
    return inside / (ends[last] - ends[first])


def at_concurrency(spec: LoadSpec, concurrency: int) -> LoadSpec:
    """``spec`` at ``concurrency`` clients, with its requests per client if it says so."""
    requests = spec.requests_per_client * concurrency if spec.requests_per_client else spec.requests
    return replace(spec, concurrency=concurrency, requests=requests)


def parse_image_size(text: str) -> tuple[int, int]:
    width, sep, height = text.lower().partition("x")
    if not sep or not width.isdigit() or not height.isdigit():
        raise ValueError(f"image size {text!r} is not WIDTHxHEIGHT, e.g. 224x224")
    return int(width), int(height)


def spec_from_args(args: argparse.Namespace, url: str | None = None, model: str | None = None) -> LoadSpec:
    try:
        spec = LoadSpec(
            url=url or args.url,
            model=model or args.model,
            concurrency=args.concurrency,
            requests=args.requests,
            max_tokens=args.max_tokens,
            image_size=parse_image_size(args.image_size),
            images_per_request=args.images_per_request,
            seed=args.seed,
            api_key=args.api_key,
            processes=args.processes,
            filler_words=args.filler_words,
            trace_alternate=getattr(args, "trace_alternate", False),
            client=getattr(args, "client", "openai"),
            requests_per_client=getattr(args, "requests_per_client", 0),
        )
        return at_concurrency(spec, spec.concurrency)
    except ValueError as exc:
        raise SystemExit(f"mmpipe bench: {exc}") from None


def import_openai() -> Any:
    """The openai client is a test extra of mmpipe, not a dependency of the server."""
    try:
        import openai
    except ImportError:
        raise SystemExit(
            "mmpipe bench drives the bridge with the official openai client, which is not installed: "
            "pip install openai (or pip install 'mmpipe[test]')"
        ) from None
    return openai


def synthetic_images(spec: LoadSpec) -> tuple[list[str], list[list[str]]]:
    """PNG ``data:`` URLs of seeded random pixels: one set for the warm-up,
    then one set per measured request, no two alike."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(spec.seed)
    width, height = spec.image_size

    def one() -> str:
        pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels, "RGB").save(buf, format="PNG")
        return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()

    warmup = [one() for _ in range(spec.images_per_request)]
    sets = [[one() for _ in range(spec.images_per_request)] for _ in range(spec.requests)]
    return warmup, sets


def _describe(exc: BaseException) -> str:
    status = getattr(exc, "status_code", None)
    text = f"{type(exc).__name__}{f' {status}' if status else ''}: {exc}".replace("\n", " ")
    return text[:200]


def traceparent(sampled: bool) -> str:
    """A W3C trace context for a new trace, asking to be recorded or not."""
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-{'01' if sampled else '00'}"


async def open_stream(
    client: openai.AsyncOpenAI, spec: LoadSpec, messages: Any, headers: dict[str, str] | None = None
) -> Any:
    """A greedy streamed chat completion of exactly ``spec.max_tokens``
    tokens (``min_tokens`` too), its usage in the last chunk."""
    return await client.chat.completions.create(
        extra_headers=headers,
        model=spec.model,
        messages=messages,
        max_tokens=spec.max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"min_tokens": spec.max_tokens},
    )


def open_client(spec: LoadSpec, timeout_s: float | None = None) -> openai.AsyncOpenAI | SseChat:
    """The client ``spec.client`` names, on ``spec.url`` (``close`` it);
    ``timeout_s``: a request's limit, unset ``spec.timeout_s``."""
    timeout = spec.timeout_s if timeout_s is None else timeout_s
    if spec.client == "aiohttp":
        return SseChat(spec.url, spec.api_key, timeout)
    openai = import_openai()
    return openai.AsyncOpenAI(base_url=spec.url, api_key=spec.api_key or "none", max_retries=0, timeout=timeout)


async def stream_events(
    client: openai.AsyncOpenAI | SseChat, spec: LoadSpec, messages: Any, headers: dict[str, str] | None = None
) -> AsyncIterator[StreamEvent]:
    """``open_stream``'s chunks as the bench reads them, from either client."""
    if isinstance(client, SseChat):
        body = {
            "model": spec.model,
            "messages": messages,
            "max_tokens": spec.max_tokens,
            "temperature": 0,
            "stream_options": {"include_usage": True},
            "min_tokens": spec.max_tokens,
        }
        async for event in client.stream(body, headers):
            yield event
        return
    async for chunk in await open_stream(client, spec, messages, headers):
        usage = None
        if chunk.usage is not None:
            details = chunk.usage.prompt_tokens_details
            cached = int(getattr(details, "cached_tokens", 0) or 0)
            usage = (chunk.usage.completion_tokens, chunk.usage.prompt_tokens, cached)
        yield choice_event(chunk.choices, usage)


async def one_request(
    client: openai.AsyncOpenAI | SseChat, spec: LoadSpec, image_urls: list[str], traced: bool | None = None
) -> RequestResult:
    """One streamed chat completion, timed from before the call to the end of
    the stream; ``traced``: sent with a traceparent asking for that."""
    content: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": url}} for url in image_urls]
    # Long prompts of distinct documents: a number first, so that they share
    # no cached prefix past the chat template (--workload multiturn measures reuse).
    text = f"({os.getpid()}.{next(_DOCUMENTS)}) {PROMPT}{' the' * spec.filler_words}" if spec.filler_words else PROMPT
    content.append({"type": "text", "text": text})
    messages: Any = [{"role": "user", "content": content}]
    first: float | None = None
    last = 0.0
    gaps: list[float] = []
    tokens: int | None = None
    prompt_tokens = cached = 0
    finish: str | None = None
    headers = None if traced is None else {"traceparent": traceparent(traced)}
    t0 = time.perf_counter()
    try:
        async for event in stream_events(client, spec, messages, headers):
            now = time.perf_counter()
            if event.choice:
                if first is None:
                    first = now
                else:
                    gaps.append(now - last)
                last = now
                finish = event.finish_reason or finish
            if event.usage is not None:
                tokens, prompt_tokens, cached = event.usage
    except Exception as exc:
        return RequestResult(
            ok=False, e2e_s=time.perf_counter() - t0, error=_describe(exc), traced=traced, ended=time.monotonic()
        )
    end = time.perf_counter()
    ended = time.monotonic()
    if first is None or tokens is None:
        error = "the stream ended without tokens" if first is None else "the stream ended without a usage chunk"
        return RequestResult(ok=False, e2e_s=end - t0, error=error, traced=traced, ended=ended)
    return RequestResult(
        ok=True,
        e2e_s=end - t0,
        ttft_s=first - t0,
        itl_s=gaps,
        tokens=tokens,
        prompt_tokens=prompt_tokens,
        finish_reason=finish,
        cached_tokens=cached,
        traced=traced,
        ended=ended,
    )


@dataclass
class LoadReport:
    spec: LoadSpec
    results: list[RequestResult]
    wall_s: float
    warmup_error: str | None = None
    # When the measured requests began (after the warm-up), wall clock.
    started_ns: int = 0
    # Each client process's CPU over the load, as a share of one core.
    client_cpu: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        done = [r for r in self.results if r.ok]
        tokens = sum(r.tokens for r in done)
        wall = max(self.wall_s, 1e-9)
        spec = asdict(self.spec)
        spec.pop("api_key")
        spec["image_size"] = "{}x{}".format(*self.spec.image_size)
        apart = {}
        if self.spec.trace_alternate:
            for label, traced in (("ttft_traced_ms", True), ("ttft_untraced_ms", False)):
                apart[label] = _stats([r.ttft_s for r in done if r.traced is traced and r.ttft_s is not None])
        if self.spec.compare_url:
            apart["compared"] = compared(self.results)
        return {
            "config": spec,
            "completed": len(done),
            "failed": len(self.results) - len(done),
            "short": sum(1 for r in done if r.tokens < self.spec.max_tokens),
            "wall_s": self.wall_s,
            "requests_per_s": len(done) / wall,
            "steady_requests_per_s": steady_rate(self.results, self.spec.concurrency),
            "tokens_per_s": tokens / wall,
            "completion_tokens": tokens,
            "prompt_tokens_mean": sum(r.prompt_tokens for r in done) / len(done) if done else 0.0,
            # A prefix cache that already held these prompts (a run before with
            # the same --seed) measures a lighter load: said, not hidden.
            "cached_tokens_mean": sum(r.cached_tokens for r in done) / len(done) if done else 0.0,
            **apart,
            "ttft_ms": _stats([r.ttft_s for r in done if r.ttft_s is not None]),
            "itl_ms": _stats([gap for r in done for gap in r.itl_s]),
            # The ITL apart: each request's first gap (its first token came from
            # prefill, its second from the decode loop it then joined) and the rest.
            "itl_first_ms": _stats([r.itl_s[0] for r in done if r.itl_s]),
            "itl_later_ms": _stats([gap for r in done for gap in r.itl_s[1:]]),
            "e2e_ms": _stats([r.e2e_s for r in done]),
            "errors": dict(Counter(r.error for r in self.results if r.error).most_common()),
            "warmup_error": self.warmup_error,
            "client_cpu": self.client_cpu,
        }


def compared(results: Sequence[RequestResult]) -> dict[str, Any]:
    """A load over two stacks (``compare_url``): each side's figures, and
    the difference (compare_url's minus url's) of each pair of requests sent
    one after the other, the first to url, the second to compare_url: what
    the host's drift, shared by both of a pair, leaves of the gap."""
    sides = {}
    for side, there in (("url", False), ("compare_url", True)):
        mine = [r for r in results if r.compared is there]
        done = [r for r in mine if r.ok]
        sides[side] = {
            "completed": len(done),
            "failed": len(mine) - len(done),
            "ttft_ms": _stats([r.ttft_s for r in done if r.ttft_s is not None]),
            "itl_ms": _stats([gap for r in done for gap in r.itl_s]),
            "e2e_ms": _stats([r.e2e_s for r in done]),
        }
    ttft: list[float] = []
    e2e: list[float] = []
    # Pairs in the order sent; a client process's last request, alone when it
    # sent an odd number, has none.
    k = 0
    while k + 1 < len(results):
        first, second = results[k], results[k + 1]
        if first.compared is False and second.compared is True:
            if first.ok and second.ok and first.ttft_s is not None and second.ttft_s is not None:
                ttft.append(second.ttft_s - first.ttft_s)
                e2e.append(second.e2e_s - first.e2e_s)
            k += 2
        else:
            k += 1
    return {**sides, "ttft_diff_ms": _stats(ttft), "e2e_diff_ms": _stats(e2e)}


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default); NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _stats(seconds: list[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for q in PERCENTILES:
        value = percentile(seconds, q)
        out[f"p{q}"] = None if math.isnan(value) else value * 1000
    out["mean"] = sum(seconds) / len(seconds) * 1000 if seconds else None
    out["n"] = len(seconds)
    return out


def client_processes(spec: LoadSpec) -> int:
    """How many processes send ``spec``'s load."""
    wanted = spec.processes or min(math.ceil(spec.concurrency / STREAMS_PER_PROCESS), (os.cpu_count() or 1) // 4)
    return max(1, min(wanted, spec.concurrency, spec.requests))


def split(spec: LoadSpec, n: int) -> list[LoadSpec]:
    """``spec`` as ``n`` loads, one per client process: its streams and
    requests shared out, each with images of its own seed (the first
    keeps ``spec``'s)."""
    streams = [spec.concurrency // n + (k < spec.concurrency % n) for k in range(n)]
    requests = [spec.requests * c // spec.concurrency for c in streams]
    for k in range(spec.requests - sum(requests)):
        requests[k % n] += 1
    return [
        replace(spec, concurrency=c, requests=r, seed=spec.seed + k, processes=1)
        for k, (c, r) in enumerate(zip(streams, requests, strict=True))
    ]


async def run_load(
    spec: LoadSpec, images: tuple[list[str], list[list[str]]] | None = None, warmup: bool = True
) -> LoadReport:
    """The warm-up request, then ``spec.requests`` requests, ``spec.concurrency``
    at a time, from one process or several (``client_processes``; then
    ``images`` are made in each, from its own seed)."""
    n = client_processes(spec)
    if n > 1:
        return await asyncio.to_thread(_run_processes, spec, n, warmup)
    run = await _run_client(spec, images or synthetic_images(spec), warmup)
    return LoadReport(
        spec=spec,
        results=run.results,
        wall_s=run.ended - run.started,
        warmup_error=run.warmup_error,
        started_ns=run.started_ns,
        client_cpu=[run.busy],
    )


@dataclass
class _ClientRun:
    results: list[RequestResult]
    started: float  # time.monotonic(): one clock for every process of the host
    ended: float
    started_ns: int
    cpu: float  # this process's CPU seconds over the load
    warmup_error: str | None

    @property
    def busy(self) -> float:
        """The share of one core this process used over the load."""
        return self.cpu / max(self.ended - self.started, 1e-9)


async def _run_client(
    spec: LoadSpec,
    images: tuple[list[str], list[list[str]]],
    warmup: bool,
    ready: Any = None,
) -> _ClientRun:
    """One process's closed loop; ``ready`` (a barrier) is passed once the
    warm-up is done, by every process at once."""
    warmup_urls, image_sets = images
    clients = [open_client(spec)]
    try:
        if spec.compare_url:
            clients.append(open_client(replace(spec, url=spec.compare_url, compare_url="")))
        warmup_error = None
        if warmup:
            # Each stack warmed up alike (the second's failure said with the first's).
            warm = [await one_request(client, spec, warmup_urls) for client in clients]
            warmup_error = "; ".join(w.error for w in warm if w.error) or None
        if ready is not None:
            ready.wait()
        results: list[RequestResult] = [RequestResult(ok=False, e2e_s=0.0, error="not run")] * spec.requests
        indices = iter(range(spec.requests))

        async def sender() -> None:
            for i in indices:  # shared by every sender: each index is taken once
                traced = (i % 2 == 0) if spec.trace_alternate else None
                there = bool(spec.compare_url) and i % 2 == 1
                result = await one_request(clients[there], spec, image_sets[i], traced)
                if spec.compare_url:
                    result.compared = there
                results[i] = result

        started_ns = time.time_ns()
        cpu0, t0 = time.process_time(), time.monotonic()
        await asyncio.gather(*(sender() for _ in range(min(spec.concurrency, spec.requests))))
        t1, cpu1 = time.monotonic(), time.process_time()
    finally:
        for client in clients:
            await client.close()
    return _ClientRun(results, t0, t1, started_ns, cpu1 - cpu0, warmup_error)


def _client_process(spec: LoadSpec, warmup: bool, ready: Any, out: Any) -> None:
    try:
        run: _ClientRun | str = asyncio.run(_run_client(spec, synthetic_images(spec), warmup, ready))
    except BaseException as exc:
        ready.abort()
        run = f"client process failed: {_describe(exc)}"
    out.put((spec.seed, run))


def _run_processes(spec: LoadSpec, n: int, warmup: bool) -> LoadReport:
    # Spawned, not forked: the parent may hold threads (an event loop, NATS).
    ctx = multiprocessing.get_context("spawn")
    loads = split(spec, n)
    ready, out = ctx.Barrier(n), ctx.Queue()
    procs = [
        ctx.Process(target=_client_process, args=(load, warmup and k == 0, ready, out), daemon=True)
        for k, load in enumerate(loads)
    ]
    for proc in procs:
        proc.start()
    try:
        runs = dict(out.get(timeout=spec.timeout_s + 120) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    failed = [r for r in runs.values() if isinstance(r, str)]
    if failed:
        raise RuntimeError("; ".join(failed))
    ordered = [runs[load.seed] for load in loads]
    done = [r for r in ordered if isinstance(r, _ClientRun)]
    started, ended = min(r.started for r in done), max(r.ended for r in done)
    return LoadReport(
        spec=spec,
        results=[result for r in done for result in r.results],
        wall_s=ended - started,
        warmup_error=done[0].warmup_error,
        started_ns=min(r.started_ns for r in done),
        client_cpu=[r.busy for r in done],
    )


def _ms(value: float | None) -> str:
    return figure(value, ".1f")


def _rate(value: float | None) -> str:
    return figure(value, ".2f")


def format_report(summary: dict[str, Any]) -> str:
    c = summary["config"]
    images = f"{c['images_per_request']}×{c['image_size']}" if c["images_per_request"] else "none"
    lines = [
        f"mmpipe bench  {c['url']}  model={c['model']}  concurrency={c['concurrency']}  "
        f"requests={c['requests']}  max_tokens={c['max_tokens']}  images={images}  seed={c['seed']}"
        f"  client={c.get('client', 'openai')}",
        f"completed {summary['completed']}  failed {summary['failed']}  short {summary['short']}  "
        f"in {summary['wall_s']:.2f} s: {summary['requests_per_s']:.2f} req/s "
        f"({_rate(summary.get('steady_requests_per_s'))} with every client busy), "
        f"{summary['tokens_per_s']:.1f} tokens/s, "
        f"prompts of {summary['prompt_tokens_mean']:.0f} tokens on average"
        f" ({summary.get('cached_tokens_mean', 0.0):.0f} of them cached)",
    ]
    rows = [
        (label, summary[key])
        for label, key in (
            ("TTFT ms", "ttft_ms"),
            ("ITL ms", "itl_ms"),
            ("  1st", "itl_first_ms"),
            ("  later", "itl_later_ms"),
            ("E2E ms", "e2e_ms"),
            ("TTFT ms, traced", "ttft_traced_ms"),
            ("TTFT ms, not traced", "ttft_untraced_ms"),
        )
        if key in summary
    ]
    w = max(len(label) for label, _ in rows)
    lines += ["", *_table(rows, w)]
    if "compared" in summary:
        lines += ["", *_format_compared(summary["compared"], c["url"], c["compare_url"], w)]
    cpu = summary.get("client_cpu") or []
    if cpu:
        shares = ", ".join(f"{c:.0%}" for c in cpu)
        lines += ["", f"client: {len(cpu)} process{'es' if len(cpu) > 1 else ''}, each busy {shares} of a core"]
        if max(cpu) > CLIENT_BUSY:
            lines.append("  a client process near a whole core: these figures may be the client's limit (--processes)")
    if summary["warmup_error"]:
        lines += ["", f"warm-up request failed: {summary['warmup_error']}"]
    if summary["errors"]:
        lines += ["", "errors:"] + [f"  {n} × {error}" for error, n in summary["errors"].items()]
    return "\n".join(lines)


def _format_compared(split: dict[str, Any], url: str, compare_url: str, width: int) -> list[str]:
    """Each side's rows, then the pairs' differences."""
    rows: list[tuple[str, dict[str, Any]]] = []
    for side, name in (("url", "A"), ("compare_url", "B")):
        rows += [(f"TTFT ms, {name}", split[side]["ttft_ms"]), (f"ITL ms, {name}", split[side]["itl_ms"])]
    rows += [("TTFT ms, B − A", split["ttft_diff_ms"]), ("E2E ms, B − A", split["e2e_diff_ms"])]
    return [
        f"A: {url} ({split['url']['completed']} completed, {split['url']['failed']} failed)",
        f"B: {compare_url} ({split['compare_url']['completed']} completed, {split['compare_url']['failed']} failed)",
        f"every other request to each; B − A over the {split['ttft_diff_ms']['n']} pairs sent one after the other",
        *_table(rows, max(width, *(len(label) for label, _ in rows))),
    ]


def _table(rows: list[tuple[str, dict[str, Any]]], width: int) -> list[str]:
    """The percentiles' header, then a row of each figure's p50, p90, p99 and mean."""
    lines = [f"{'':<{width}}{'p50':>10}{'p90':>10}{'p99':>10}{'mean':>10}"]
    for label, s in rows:
        lines.append(f"{label:<{width}}{_ms(s['p50']):>10}{_ms(s['p90']):>10}{_ms(s['p99']):>10}{_ms(s['mean']):>10}")
    return lines


def main(args: argparse.Namespace) -> int:
    from pipeline.bench import run_async

    spec = spec_from_args(args)
    if args.compare_url:
        try:
            spec = replace(spec, compare_url=args.compare_url)
        except ValueError as exc:
            raise SystemExit(f"mmpipe bench: {exc}") from None
    if args.breakdown:
        return _with_breakdown(args, spec)
    before = scrape_engines(args)
    summary = run_async(run_load(spec)).summary()
    text = format_report(summary) + report_engine_calls(args, before, summary)
    print(json.dumps(summary, indent=2) if args.json else text, flush=True)
    return 1 if summary["failed"] else 0


def scrape_engines(args: argparse.Namespace) -> dict[str, Any]:
    """Each --engine-metrics URL's samples before the load."""
    from pipeline.bench.engine_calls import scrape

    return {url: scrape(url) for url in getattr(args, "engine_metrics", None) or []}


def report_engine_calls(args: argparse.Namespace, before: dict[str, Any], summary: dict[str, Any]) -> str:
    """The engine threads' share of the load, into ``summary`` and as text."""
    from pipeline.bench.engine_calls import format_engine_calls, scrape, summarize

    if not before:
        return ""
    summary["engine_calls"] = {url: summarize(b, scrape(url), summary["wall_s"]) for url, b in before.items()}
    return "".join(f"\n\n{format_engine_calls(url, s)}" for url, s in summary["engine_calls"].items())


def _with_breakdown(args: argparse.Namespace, spec: LoadSpec) -> int:
    """The load, with the stack's spans collected while it runs (the stack
    must run with --trace-nats on this NATS and namespace)."""
    from pipeline.bench.breakdown import SpanSink, format_summary, spans_collected, summarize, with_stack_spans

    async def run(nats_url: str) -> tuple[LoadReport, SpanSink]:
        async with spans_collected(nats_url, args.namespace) as sink:
            report = await run_load(spec)
        return report, sink

    before = scrape_engines(args)
    report, sink = with_stack_spans(args, run)
    summary = report.summary()
    summary["breakdown"] = summarize(sink, since_ns=report.started_ns)
    engines = report_engine_calls(args, before, summary)
    if args.json:
        print(json.dumps(summary, indent=2), flush=True)
    else:
        print(format_report(summary) + "\n\n" + format_summary(summary["breakdown"]) + engines, flush=True)
    return 1 if summary["failed"] else 0
