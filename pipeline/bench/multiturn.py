"""``mmpipe bench --workload multiturn``: conversations with an image, as
chat clients hold them.

Each of ``--users`` users sends one image and a long first message
(``--filler-words``), then, once each answer is in, the whole conversation
so far plus a short question, for ``--turns`` turns; the users run at once,
each holding ``--conversations`` conversations one after another (each with
an image of its own: more samples of every turn).
Every turn after the first starts as the one before it did, so a server
that caches prefixes prefills only what is new. Reported per turn: TTFT,
the prompt's tokens and how many the server says it served from its cache
(``usage.prompt_tokens_details.cached_tokens``), and the hit rate (cached
over prompt tokens); and requests/s over the whole run. With ``--breakdown``
(a stack run with --trace-nats), where the first token's time went, from
the spans, for the first turns and for the later ones apart.

``--router kv,round-robin`` starts ``mmpipe up --router R`` for each (with
``--router-workers`` as its ``--workers``, and ``--up-arg`` flags), one
after the other, and drives the same conversations at each; with
``--router-workers``, a stack of one worker per role goes first: the hit
rate that spreading the users over several workers should keep.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from pipeline.bench.breakdown import format_summary as format_breakdown
from pipeline.bench.breakdown import spans_collected, with_stack_spans
from pipeline.bench.breakdown import summarize as summarize_spans
from pipeline.bench.load import (
    PROMPT,
    LoadSpec,
    open_client,
    percentile,
    spec_from_args,
    stream_events,
    synthetic_images,
)
from pipeline.bench.results import figure
from pipeline.config import ROUTERS


@dataclass
class Turn:
    user: int
    turn: int
    ok: bool
    ttft_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    # Wall-clock ns (the spans' clock): sent, and its first token in.
    sent_ns: int = 0
    first_ns: int = 0


async def _converse(client: Any, spec: LoadSpec, user: int, image_url: str, turns: int) -> list[Turn]:
    content = [
        {"type": "image_url", "image_url": {"url": image_url}},
        {"type": "text", "text": PROMPT + " the" * spec.filler_words},
    ]
    messages: list[dict[str, Any]] = [{"role": "user", "content": content}]
    out: list[Turn] = []
    for turn in range(1, turns + 1):
        sent_ns, started = time.time_ns(), time.perf_counter()
        first: float | None = None
        text: list[str] = []
        usage: tuple[int, int, int] | None = None
        try:
            async for event in stream_events(client, spec, messages):
                if event.choice:
                    first = first or time.perf_counter()
                    text.append(event.text)
                if event.usage is not None:
                    usage = event.usage
        except Exception as exc:
            out.append(Turn(user, turn, ok=False, error=f"{type(exc).__name__}: {exc}"[:200]))
            return out  # a conversation whose turn failed does not go on
        if first is None or usage is None:
            out.append(Turn(user, turn, ok=False, error="the stream ended without tokens or usage"))
            return out
        _, prompt_tokens, cached = usage
        first_ns = sent_ns + int((first - started) * 1e9)
        out.append(Turn(user, turn, True, first - started, prompt_tokens, cached, None, sent_ns, first_ns))
        messages += [
            {"role": "assistant", "content": "".join(text)},
            {"role": "user", "content": f"Turn {turn + 1}: and what else do you see?"},
        ]
    return out


async def run(spec: LoadSpec, users: int, turns: int, conversations: int = 1) -> dict[str, Any]:
    done, wall, warmup_error = await _drive(spec, users, turns, conversations)
    return summarize(done, wall, spec, users, turns, warmup_error, conversations)


async def run_traced(
    spec: LoadSpec, users: int, turns: int, conversations: int, nats_url: str, namespace: str
) -> dict[str, Any]:
    """``run``, and where the first token's time went in the first turns and
    in the later ones (``--breakdown``: the stack runs with --trace-nats)."""
    async with spans_collected(nats_url, namespace) as sink:
        done, wall, warmup_error = await _drive(spec, users, turns, conversations)
    summary = summarize(done, wall, spec, users, turns, warmup_error, conversations)
    ok = [t for t in done if t.ok]
    summary["breakdown"] = {
        label: summarize_spans(sink, within=[(t.sent_ns, t.first_ns) for t in ok if (t.turn > 1) == later])
        for label, later in (("turn 1", False), ("turns after the first", True))
    }
    return summary


async def _drive(spec: LoadSpec, users: int, turns: int, conversations: int) -> tuple[list[Turn], float, str | None]:
    """Each user's conversations one after another, the users at once: the
    turns, the wall time and the warm-up's error."""
    warmup, images = synthetic_images(dataclasses.replace(spec, requests=users * conversations, images_per_request=1))
    client = open_client(spec, timeout_s=600)

    async def user(u: int) -> list[Turn]:
        out: list[Turn] = []
        for c in range(conversations):
            out += await _converse(client, spec, u, images[u * conversations + c][0], turns)
        return out

    try:
        # Lazy start-up paid outside the measured turns (its own image: no prefix shared).
        warm = await _converse(client, spec, -1, warmup[0], 1)
        t0 = time.monotonic()
        done = await asyncio.gather(*(user(u) for u in range(users)))
        wall = time.monotonic() - t0
    finally:
        await client.close()
    return [t for turns_of_user in done for t in turns_of_user], wall, warm[0].error


def summarize(
    turns_done: list[Turn],
    wall_s: float,
    spec: LoadSpec,
    users: int,
    turns: int,
    warmup_error: str | None = None,
    conversations: int = 1,
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
    later_ttfts = [t.ttft_s for t in later]
    return {
        "users": users,
        "turns": turns,
        "conversations": conversations,
        "client": spec.client,
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
        "ttft_ms_p50_after_first": percentile(later_ttfts, 50) * 1e3 if later_ttfts else None,
    }


def format_summary(s: dict[str, Any]) -> str:
    def ms(v: float | None) -> str:
        return figure(v, ".1f")

    lines = [
        f"mmpipe bench --workload multiturn  users={s['users']}  conversations={s['conversations']}  "
        f"turns={s['turns']}  max_tokens={s['max_tokens']}  filler_words={s['filler_words']}  client={s['client']}",
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
    for label, b in (s.get("breakdown") or {}).items():
        lines += ["", f"== where the first token's time went, {label}", format_breakdown(b)]
    return "\n".join(lines)


ONE_WORKER = "one worker"


def compare_routers(args: argparse.Namespace, routers: list[str]) -> list[dict[str, Any]]:
    """The same conversations on ``mmpipe up`` with each router (and first,
    with ``--router-workers``, on one worker per role)."""
    from pipeline.bench import run_async
    from pipeline.bench.modes import mmpipe_up

    spec = spec_from_args(args)
    mode = args.modes.split(",")[0] if args.modes else "epd"
    runs = [(ONE_WORKER, ())] if args.router_workers else []
    runs += [
        (r, ("--router", r, *(("--workers", args.router_workers) if args.router_workers else ()))) for r in routers
    ]
    rows = []
    for label, flags in runs:
        print(f"{label}: starting mmpipe up ...", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(prefix="mmpipe-bench-router-") as tmp:
            extra = (*flags, *args.up_arg)
            with mmpipe_up(mode, spec.model, args.transport, Path(tmp), spec.api_key, extra=extra) as (url, _):
                on = dataclasses.replace(spec, url=url, model=Path(spec.model).name)
                row = run_async(run(on, args.users, args.turns, args.conversations))
                rows.append({"router": label, **row, "encode_skipped": encode_hops_skipped(url)})
    return rows


def encode_hops_skipped(url: str) -> int | None:
    """The requests the bridge's router sent past the encode hop (their
    media's tokens cached on a prefill worker), from its /metrics; None
    where it does not say."""
    base = url.removesuffix("/").removesuffix("/v1")
    try:
        with urllib.request.urlopen(f"{base}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "mmpipe_router_decisions_total" and sample.labels == {"role": "encode", "to": "skipped"}:
                return int(sample.value)
    return 0


def format_routers(rows: list[dict[str, Any]]) -> str:
    one = next((r for r in rows if r["router"] == ONE_WORKER), None)
    rr = next((r for r in rows if r["router"] == "round-robin"), None)
    lines = []
    for r in rows:
        lines += [f"== {r['router']}", format_summary(r), ""]
    lines.append(
        f"{'router':<14}{'req/s':>8}{'hit rate':>10}{'x one worker':>14}{'TTFT p50 turn>=2':>18}{'x round-robin':>15}"
        f"{'encodes skipped':>17}"
    )
    for r in rows:
        hit, ttft = r["hit_rate_after_first"], r["ttft_ms_p50_after_first"]
        hit_x = hit / one["hit_rate_after_first"] if one and hit is not None and one["hit_rate_after_first"] else None
        base = rr["ttft_ms_p50_after_first"] if rr else None
        ttft_x = ttft / base if ttft is not None and base else None
        lines.append(
            f"{r['router']:<14}{figure(r['requests_per_s'], '.2f'):>8}"
            f"{figure(hit, '.2f'):>10}{figure(hit_x, '.2f'):>14}"
            f"{figure(ttft, '.1f'):>18}{figure(ttft_x, '.2f'):>15}{figure(r.get('encode_skipped'), 'd'):>17}"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from pipeline.bench import run_async

    if args.users < 1 or args.turns < 1 or args.conversations < 1:
        raise SystemExit("mmpipe bench: --users, --turns and --conversations must be at least 1")
    routers = [r.strip() for r in (args.router or "").split(",") if r.strip()]
    if routers and args.breakdown:
        raise SystemExit("mmpipe bench: --breakdown reads a running stack's spans: not with --router (run one stack)")
    if routers:
        unknown = [r for r in routers if r not in ROUTERS]
        if unknown:
            raise SystemExit(f"mmpipe bench: --router {', '.join(unknown)}: routers are {', '.join(ROUTERS)}")
        try:
            rows = compare_routers(args, routers)
        except RuntimeError as exc:  # a stack did not start: the message says why
            print(f"mmpipe bench: {exc}", file=sys.stderr, flush=True)
            return 1
        print(json.dumps(rows, indent=2) if args.json else format_routers(rows), flush=True)
        return 1 if any(r["failed"] for r in rows) else 0
    spec = spec_from_args(args)
    if args.breakdown:
        summary = with_stack_spans(
            args, lambda url: run_traced(spec, args.users, args.turns, args.conversations, url, args.namespace)
        )
    else:
        summary = run_async(run(spec, args.users, args.turns, args.conversations))
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary), flush=True)
    return 1 if summary["failed"] else 0
