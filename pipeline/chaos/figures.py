"""The figures of a chaos scenario, how a stream is judged, and the table."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.chaos.client import Result


@dataclass
class Figures:
    scenario: str
    accepted: int = 0
    completed: int = 0
    # Accepted and never completed (an error, a hang, a stream cut short).
    lost: int = 0
    duplicate_tokens: int = 0
    missing_tokens: int = 0
    # Tokens of completed streams whose text is not the expected one at their place.
    wrong_tokens: int = 0
    # Per disturbance: the longest a request in flight then waited for its next chunk.
    recovery_s: list[float] = field(default_factory=list)
    # Refusals (429 at overload, 503 while NATS is down) and how fast they came.
    refused: int = 0
    rejected_429: int = 0
    # p99 of the 429s' time to answer as the client saw it, and as the bridge took it.
    p99_429_ms: float | None = None
    p99_429_bridge_ms: float | None = None
    missing_retry_after: int = 0
    sustainable_rps: float | None = None
    offered_rps: float | None = None
    # Peak RSS (MiB) per role over the scenario, and what a worker may hold beyond its model.
    peak_rss_mib: dict[str, float] = field(default_factory=dict)
    rss_growth_mib: dict[str, float] = field(default_factory=dict)
    budget_mib: dict[str, float] = field(default_factory=dict)
    # Sequences swapped out of a decode worker's KV pool over the scenario, every
    # decode worker that ran counted (a killed one as it was just before the kill).
    preemptions: float = 0.0
    notes: list[str] = field(default_factory=list)
    # Accepted requests that did not complete, for the report.
    failures: list[str] = field(default_factory=list)

    @property
    def worst_recovery_s(self) -> float:
        return max(self.recovery_s, default=0.0)

    def judge(self, result: Result, expected: list[str] | None) -> None:
        """Count one request: taken or not, completed, tokens as expected."""
        if not result.accepted:
            self.refused += 1
            return
        self.accepted += 1
        if not result.completed:
            self.lost += 1
            self.failures.append(
                f"#{result.job.index} status={result.status} code={result.code} error={result.error} "
                f"chunks={len(result.texts)} finish={result.finish}"
            )
            return
        self.completed += 1
        # Every relayed chunk carries exactly one token (stages/emitter.py).
        n = result.job.max_tokens
        self.duplicate_tokens += max(0, len(result.texts) - n)
        self.missing_tokens += max(0, n - len(result.texts))
        if expected is not None and result.texts != expected:
            self.wrong_tokens += sum(a != b for a, b in zip(result.texts, expected, strict=False))
            self.failures.append(
                f"#{result.job.index} variant={result.job.variant}: {result.text!r} != {''.join(expected)!r}"
            )

    @property
    def ok(self) -> bool:
        return (
            self.accepted > 0
            and self.lost == 0
            and self.duplicate_tokens == 0
            and self.missing_tokens == 0
            and self.wrong_tokens == 0
            and not self.failures
        )


def recovery(results: list[Result], at: float) -> tuple[float, Result | None]:
    """How long the requests in flight at ``at`` waited for their next chunk
    (or their end): the worst of them, and which."""
    worst, who = 0.0, None
    for r in results:
        if not r.started or r.started > at or (r.ended and r.ended <= at):
            continue
        after = [t for t in r.times if t > at]
        nxt = after[0] if after else (r.ended or at)
        if nxt - at > worst:
            worst, who = nxt - at, r
    return worst, who


def p99(values: list[float]) -> float | None:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else None


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


COLUMNS = (
    "scenario", "accepted", "completed", "lost", "dup tok", "missing tok", "wrong tok",
    "worst recovery s", "429", "p99 429 ms", "in bridge", "refused",
)  # fmt: skip


def table(figures: list[Figures]) -> str:
    rows = [list(COLUMNS)]
    for f in figures:
        rows.append(
            [
                f.scenario, str(f.accepted), str(f.completed), str(f.lost), str(f.duplicate_tokens),
                str(f.missing_tokens), str(f.wrong_tokens), _fmt(f.worst_recovery_s if f.recovery_s else None),
                str(f.rejected_429), _fmt(f.p99_429_ms), _fmt(f.p99_429_bridge_ms), str(f.refused),
            ]
        )  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in rows]  # fmt: skip
    lines.insert(1, "  ".join("-" * w for w in widths))
    roles = sorted({role for f in figures for role in f.peak_rss_mib})
    if roles:
        lines += ["", "peak RSS MiB per role (growth during the scenario / what a worker may hold beyond its model):"]
        for f in figures:
            cells = [
                f"{role} {f.peak_rss_mib[role]:.0f}"
                + (f" (+{f.rss_growth_mib[role]:.0f}/{f.budget_mib[role]:.0f})" if role in f.rss_growth_mib else "")
                for role in roles
                if role in f.peak_rss_mib
            ]
            lines.append(f"  {f.scenario}: " + ", ".join(cells))
    for f in figures:
        lines += [f"{f.scenario}: {note}" for note in f.notes]
        lines += [f"{f.scenario}: FAILED {failure}" for failure in f.failures[:10]]
    return "\n".join(lines)
