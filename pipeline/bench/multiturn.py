"""``mmpipe bench --workload multiturn``: conversations with an image, as
chat clients hold them.

Each of ``--users`` users sends one image and a long first message
(``--filler-words``), then, once each answer is in, the whole conversation
so far plus a short question, for ``--turns`` turns; the users run at once.
Every turn after the first starts as the one before it did, so a server
that caches prefixes prefills only what is new. Reported per turn: TTFT,
the prompt's tokens and how many the server says it served from its cache
(``usage.prompt_tokens_details.cached_tokens``), and the hit rate (cached
over prompt tokens); and requests/s over the whole run.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any

from pipeline.bench.load import (
    PROMPT,
    LoadSpec,
    import_openai,
    open_stream,
    percentile,
    spec_from_args,
    synthetic_images,
)


@dataclass
class Turn:
    user: int
    turn: int
    ok: bool
    ttft_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


async def _converse(client: Any, spec: LoadSpec, user: int, image_url: str, turns: int) -> list[Turn]:
    content = [
        {"type": "image_url", "image_url": {"url": image_url}},
        {"type": "text", "text": PROMPT + " the" * spec.filler_words},
    ]
    messages: list[dict[str, Any]] = [{"role": "user", "content": content}]
    out: list[Turn] = []
    for turn in range(1, turns + 1):
        started = time.perf_counter()
        first: float | None = None
        text: list[str] = []
        usage: Any = None
        try:
            stream = await open_stream(client, spec, messages)
            async for chunk in stream:
                if chunk.choices:
                    first = first or time.perf_counter()
                    text.append(chunk.choices[0].delta.content or "")
                if chunk.usage is not None:
                    usage = chunk.usage
        except Exception as exc:
            out.append(Turn(user, turn, ok=False, error=f"{type(exc).__name__}: {exc}"[:200]))
            return out  # a conversation whose turn failed does not go on
        if first is None or usage is None:
            out.append(Turn(user, turn, ok=False, error="the stream ended without tokens or usage"))
            return out
        details = getattr(usage, "prompt_tokens_details", None)
        cached = int(getattr(details, "cached_tokens", 0) or 0)
        out.append(Turn(user, turn, True, first - started, usage.prompt_tokens, cached))
        messages += [
            {"role": "assistant", "content": "".join(text)},
            {"role": "user", "content": f"Turn {turn + 1}: and what else do you see?"},
        ]
    return out


async def run(spec: LoadSpec, users: int, turns: int) -> dict[str, Any]:
    openai = import_openai()
    warmup, images = synthetic_images(dataclasses.replace(spec, requests=users, images_per_request=1))
    client = openai.AsyncOpenAI(base_url=spec.url, api_key=spec.api_key or "none", max_retries=0, timeout=600)
    try:
        # Lazy start-up paid outside the measured turns (its own image: no prefix shared).
        warm = await _converse(client, spec, -1, warmup[0], 1)
        t0 = time.monotonic()
        done = await asyncio.gather(*(_converse(client, spec, u, images[u][0], turns) for u in range(users)))
        wall = time.monotonic() - t0
    finally:
        await client.close()
    return summarize([t for conversation in done for t in conversation], wall, spec, users, turns, warm[0].error)


def summarize(
    turns_done: list[Turn], wall_s: float, spec: LoadSpec, users: int, turns: int, warmup_error: str | None = None
) -> dict[str, Any]:
    ok = [t for t in turns_done if t.ok]
    per_turn = []
    for turn in range(1, turns + 1):
        these = [t for t in ok if t.turn == turn]
        prompt = sum(t.prompt_tokens for t in these)
        cached = sum(t.cached_tokens for t in these)
        ttfts = [t.ttft_s for t in these]
        per_turn.append(
            {
                "turn": turn,
                "completed": len(these),
                "ttft_ms_p50": percentile(ttfts, 50) * 1e3 if ttfts else None,
                "ttft_ms_p90": percentile(ttfts, 90) * 1e3 if ttfts else None,
                "prompt_tokens_mean": prompt / len(these) if these else None,
                "cached_tokens_mean": cached / len(these) if these else None,
                "hit_rate": cached / prompt if prompt else None,
            }
        )
    later = [t for t in ok if t.turn > 1]
    later_prompt = sum(t.prompt_tokens for t in later)
    return {
        "users": users,
        "turns": turns,
        "max_tokens": spec.max_tokens,
        "filler_words": spec.filler_words,
        "completed": len(ok),
        "failed": len(turns_done) - len(ok),
        "errors": sorted({t.error for t in turns_done if t.error}),
        "warmup_error": warmup_error,
        "wall_s": wall_s,
        "requests_per_s": len(ok) / max(wall_s, 1e-9),
        "per_turn": per_turn,
        # Of every turn after the first: prompt tokens the server served from its cache.
        "hit_rate_after_first": sum(t.cached_tokens for t in later) / later_prompt if later_prompt else None,
    }


def format_summary(s: dict[str, Any]) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    lines = [
        f"mmpipe bench --workload multiturn  users={s['users']}  turns={s['turns']}  max_tokens={s['max_tokens']}  "
        f"filler_words={s['filler_words']}",
        f"completed {s['completed']}  failed {s['failed']}  in {s['wall_s']:.2f} s: {s['requests_per_s']:.2f} req/s",
        "",
        f"{'turn':>4}{'done':>6}{'TTFT p50 ms':>13}{'TTFT p90 ms':>13}{'prompt tok':>12}{'cached tok':>12}"
        f"{'hit rate':>10}",
    ]
    for t in s["per_turn"]:
        rate = "-" if t["hit_rate"] is None else f"{t['hit_rate']:.2f}"
        prompt = "-" if t["prompt_tokens_mean"] is None else f"{t['prompt_tokens_mean']:.0f}"
        cached = "-" if t["cached_tokens_mean"] is None else f"{t['cached_tokens_mean']:.0f}"
        lines.append(
            f"{t['turn']:>4}{t['completed']:>6}{ms(t['ttft_ms_p50']):>13}{ms(t['ttft_ms_p90']):>13}"
            f"{prompt:>12}{cached:>12}{rate:>10}"
        )
    if s["hit_rate_after_first"] is not None:
        lines += ["", f"prefix hit rate of the turns after the first: {s['hit_rate_after_first']:.2f}"]
    if s["warmup_error"]:
        lines += ["", f"warm-up failed: {s['warmup_error']}"]
    lines += [f"error: {e}" for e in s["errors"]]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from pipeline.bench import run_async

    if args.users < 1 or args.turns < 1:
        raise SystemExit("mmpipe bench: --users and --turns must be at least 1")
    summary = run_async(run(spec_from_args(args), args.users, args.turns))
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary), flush=True)
    return 1 if summary["failed"] else 0
