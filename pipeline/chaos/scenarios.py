"""The chaos scenarios. Each drives the bridge of a running ``ChaosStack``
with streamed requests, disturbs the stack, and judges every stream.

- crash: SIGKILL one worker of each role in turn while requests are in
  flight (the decode worker mid-stream), respawning each;
- nats-restart: stop the nats-server and start it on the same store while
  requests are queued and in flight;
- overload: measure the sustainable rate, then offer 10x it (at least twice
  what the stack can hold) with small queues: what cannot be taken gets 429
  at once, the rest completes.

Greedy requests must equal transformers ``generate()``; sampled ones (a
fixed seed each) must equal the same request on the undisturbed stack.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import aiohttp

from pipeline.chaos.client import Job, Result, session, stream
from pipeline.chaos.figures import Figures, p99, recovery
from pipeline.chaos.reference import Reference
from pipeline.chaos.stack import ChaosStack, Member, metric
from pipeline.config import PipelineConfig
from pipeline.connection import connect
from pipeline.streams import ensure_streams, stream_configs
from schemas.routes import PROCESSOR

PREEMPTIONS = "mmpipe_preemptions_total"

SCENARIOS = ("crash", "nats-restart", "overload")


@dataclass(frozen=True)
class ChaosSpec:
    concurrency: int = 16
    # Requests per scenario (a crash run goes on until its kills are done, up to 4x this).
    requests: int = 48
    max_tokens: int = 48
    # Variants: half greedy, half sampled at this temperature with a fixed seed.
    variants: int = 8
    temperature: float = 0.8
    # Seconds between two kills (the killed worker is respawned at once).
    kill_gap_s: float = 1.0
    nats_down_s: float = 1.0
    overload_factor: float = 10.0
    overload_seconds: float = 3.0
    # Most requests offered in the overload burst (a bound on the loop).
    overload_cap: int = 400
    # max_msgs of the work queues during the burst: small, so they fill fast.
    overload_queue: int = 4
    overload_tokens: int = 16
    request_timeout_s: float = 120.0


class Peaks:
    """Peak RSS per role while the block runs (sampled every 0.2 s)."""

    def __init__(self, stack: ChaosStack) -> None:
        self.stack = stack
        self.before: dict[str, int] = {}
        self.peaks: dict[str, int] = {}
        self._sampling = False
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Peaks:
        self.before = await asyncio.to_thread(self.stack.rss)
        self.peaks = dict(self.before)
        self._sampling = True
        self._task = asyncio.create_task(self._sample())
        return self

    async def _sample(self) -> None:
        while self._sampling:
            for role, rss in (await asyncio.to_thread(self.stack.rss)).items():
                self.peaks[role] = max(self.peaks.get(role, 0), rss)
            await asyncio.sleep(0.2)

    async def __aexit__(self, *exc: object) -> None:
        self._sampling = False
        if self._task is not None:
            await self._task

    def fill(self, figures: Figures) -> None:
        mib = 1 << 20
        figures.peak_rss_mib = {role: rss / mib for role, rss in self.peaks.items()}
        figures.rss_growth_mib = {role: (rss - self.before.get(role, rss)) / mib for role, rss in self.peaks.items()}
        figures.budget_mib = {role: self.stack.budget_bytes(role) / mib for role in self.peaks}


def make_job(spec: ChaosSpec, index: int, max_tokens: int | None = None) -> Job:
    variant = index % spec.variants
    sampled = variant >= spec.variants // 2
    return Job(
        index=index,
        variant=variant,
        max_tokens=max_tokens or spec.max_tokens,
        temperature=spec.temperature if sampled else 0.0,
        seed=1000 + variant if sampled else None,
    )


@dataclass
class Run:
    """One event loop's view of a stack: its client session and what each
    variant must answer."""

    stack: ChaosStack
    spec: ChaosSpec
    reference: Reference
    # (variant, max_tokens) -> chunk texts of a sampled variant on the undisturbed stack.
    baselines: dict[tuple[int, int], list[str]] = field(default_factory=dict)
    http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Run:
        self.http = session(max(64, self.spec.overload_cap))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.http is not None:
            await self.http.close()

    async def one(self, job: Job, result: Result | None = None) -> Result:
        assert self.http is not None
        return await stream(
            self.http, self.stack.base_url, job, self.stack.served_name, self.spec.request_timeout_s, result
        )

    async def expected(self, job: Job) -> list[str] | None:
        if job.temperature == 0:
            return await asyncio.to_thread(self.reference.text, job)
        return self.baselines.get((job.variant, job.max_tokens))

    async def prime(self, max_tokens: int) -> None:
        """Each sampled variant once on the undisturbed stack: its answer."""
        jobs = [make_job(self.spec, v, max_tokens) for v in range(self.spec.variants)]
        todo = [j for j in jobs if j.temperature > 0 and (j.variant, max_tokens) not in self.baselines]
        for job, r in zip(todo, await asyncio.gather(*(self.one(j) for j in todo)), strict=True):
            if not r.completed:
                raise RuntimeError(f"the undisturbed stack failed a request: {r}")
            self.baselines[(job.variant, max_tokens)] = r.texts

    async def drive(self, next_job: Callable[[], Job | None], live: list[Result], retry_refused: bool = True) -> None:
        """``concurrency`` clients, each sending the next job when its last
        ended; a refused request is sent again after its Retry-After (bounded)."""

        async def lane() -> None:
            while (job := next_job()) is not None:
                for _ in range(30):
                    r = Result(job=job)
                    live.append(r)
                    await self.one(job, r)
                    if r.accepted or not retry_refused:
                        break
                    await asyncio.sleep(min(2.0, float(r.retry_after or 0.5)))

        await asyncio.gather(*(lane() for _ in range(self.spec.concurrency)))

    async def judge(self, figures: Figures, results: list[Result]) -> Figures:
        greedy = sampled = 0
        for r in results:
            expected = await self.expected(r.job) if r.completed else None
            figures.judge(r, expected)
            if expected is not None:
                greedy += r.job.temperature == 0
                sampled += r.job.temperature > 0
        figures.notes.append(
            f"compared: {greedy} greedy streams with generate(), {sampled} sampled "
            f"(temperature {self.spec.temperature}, fixed seeds) with the undisturbed stack"
        )
        return figures


def _jobs(
    spec: ChaosSpec, limit: int, until: asyncio.Event | None = None, max_tokens: int | None = None
) -> Callable[[], Job | None]:
    """Jobs 0, 1, ...: ``limit`` of them, or while ``until`` is unset, up to 4x."""
    count = 0

    def next_job() -> Job | None:
        nonlocal count
        if count >= 4 * limit or (count >= limit and (until is None or until.is_set())):
            return None
        count += 1
        return make_job(spec, count - 1, max_tokens)

    return next_job


async def _mid_stream(live: list[Result], timeout_s: float = 60.0) -> bool:
    """Wait until some request has had a chunk and not its last."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(r.texts and not r.ended for r in live):
            return True
        await asyncio.sleep(0.02)
    return False


async def _busiest(stack: ChaosStack, role: str, timeout_s: float = 5.0) -> tuple[Member, float]:
    """The worker of ``role`` with the most requests in hand (waits a little for one with any)."""
    deadline = time.monotonic() + timeout_s
    while True:
        members = stack.workers(role)
        counts = await asyncio.gather(*(asyncio.to_thread(stack.inflight, m) for m in members))
        best = max(zip(counts, range(len(members)), strict=True))
        if best[0] > 0 or time.monotonic() > deadline:
            return members[best[1]], best[0]
        await asyncio.sleep(0.02)


async def crash(run: Run) -> Figures:
    stack, spec = run.stack, run.spec
    figures = Figures("crash")
    await run.prime(spec.max_tokens)
    live: list[Result] = []
    kills: list[float] = []
    done = asyncio.Event()

    async def killer() -> None:
        try:
            # Each hop's role in route order, then the processor.
            for role in [*(r for r in stack.roles if r != PROCESSOR), PROCESSOR]:
                await _mid_stream(live)
                victim, inflight = await _busiest(stack, role)
                if "decode" in role:  # what it preempted goes with it
                    figures.preemptions += await asyncio.to_thread(metric, victim, PREEMPTIONS)
                stack.kill(victim)
                kills.append(time.monotonic())
                figures.notes.append(f"SIGKILL {role} pid {victim.popen.pid} holding {inflight:.0f} requests")
                stack.spawn(role)
                await asyncio.sleep(spec.kill_gap_s)
        finally:
            done.set()

    async with Peaks(stack) as peaks:
        killing = asyncio.create_task(killer())
        await run.drive(_jobs(spec, spec.requests, done), live)
        await killing
    peaks.fill(figures)
    started = time.monotonic()
    await asyncio.to_thread(stack.wait_ready, 180.0)
    figures.notes.append(f"respawned workers ready {time.monotonic() - started:.1f}s after the load ended")
    for member in [m for r in stack.roles if "decode" in r for m in stack.workers(r)]:
        figures.preemptions += await asyncio.to_thread(metric, member, PREEMPTIONS)
    figures.notes.append(f"KV pool preemptions across decode workers: {figures.preemptions:.0f}")
    worst = [recovery(live, t) for t in kills]
    figures.recovery_s = [s for s, _ in worst]
    figures.notes.append(
        "recovery per kill (s): " + ", ".join(f"{s:.1f} ({r.request_id if r else '-'})" for s, r in worst)
    )
    return await run.judge(figures, live)


async def _queued(stack: ChaosStack) -> int:
    config = PipelineConfig(nats_url=stack.nats_url, namespace=stack.options.namespace, mode=stack.options.mode)
    nc, js = await connect(stack.nats_url, "chaos-probe")
    try:
        total = 0
        for cfg in stream_configs(config):
            if cfg.name and cfg.name not in (config.subjects.reply_stream, config.subjects.dead_stream):
                total += (await js.stream_info(cfg.name)).state.messages
        return total
    finally:
        await nc.close()


async def nats_restart(run: Run) -> Figures:
    stack, spec = run.stack, run.spec
    figures = Figures("nats-restart")
    await run.prime(spec.max_tokens)
    live: list[Result] = []
    restarts: list[float] = []
    done = asyncio.Event()

    async def restarter() -> None:
        try:
            await _mid_stream(live)
            queued = await _queued(stack)
            inflight = sum(1 for r in live if not r.ended)
            restarts.append(time.monotonic())
            await asyncio.wrap_future(stack.restart_nats(spec.nats_down_s))
            figures.notes.append(
                f"nats-server restarted (down {spec.nats_down_s:.1f}s) with {inflight} requests open, {queued} queued"
            )
        finally:
            done.set()

    async with Peaks(stack) as peaks:
        restarting = asyncio.create_task(restarter())
        await run.drive(_jobs(spec, spec.requests, done), live)
        await restarting
    peaks.fill(figures)
    # Everyone back by themselves: every worker ready, the bridge sees every role.
    await asyncio.to_thread(stack.wait_ready, 60.0)
    after = await run.one(make_job(spec, 0))
    live.append(after)
    figures.notes.append(f"after the restart a new request {'completed' if after.completed else 'FAILED'}")
    figures.recovery_s = [recovery(live, t)[0] for t in restarts]
    return await run.judge(figures, live)


async def _queue_limit(stack: ChaosStack, max_msgs: int | None) -> None:
    """Shrink the work queues' max_msgs on the running server (what an
    operator would do with ``nats stream edit``); None puts the configured
    limits back."""
    config = PipelineConfig(nats_url=stack.nats_url, namespace=stack.options.namespace, mode=stack.options.mode)
    nc, js = await connect(stack.nats_url, "chaos-limits")
    try:
        if max_msgs is None:
            await ensure_streams(js, config)
            return
        for cfg in stream_configs(config):
            if cfg.name in (config.subjects.reply_stream, config.subjects.dead_stream):
                continue
            await js.update_stream(replace(cfg, max_msgs=max_msgs))
    finally:
        await nc.close()


async def overload(run: Run) -> Figures:
    stack, spec = run.stack, run.spec
    figures = Figures("overload")
    tokens = spec.overload_tokens
    await run.prime(tokens)
    # The sustainable rate: closed loop, `concurrency` clients.
    measured: list[Result] = []
    started = time.monotonic()
    await run.drive(_jobs(spec, spec.requests, max_tokens=tokens), measured, retry_refused=False)
    elapsed = time.monotonic() - started
    rate = sum(r.completed for r in measured) / elapsed
    figures.sustainable_rps = rate
    # At least twice what the stack can hold, within the burst's seconds: on a
    # slow machine 10x the rate can still fit in the workers' windows and the
    # queues, and then nothing is refused because nothing is overloaded.
    holds = stack.holds(spec.overload_queue)
    offered = max(spec.overload_factor * rate, 2 * holds / spec.overload_seconds)
    figures.offered_rps = offered
    count = max(1, min(spec.overload_cap, int(offered * spec.overload_seconds)))
    burst: list[Result] = []
    await _queue_limit(stack, spec.overload_queue)
    try:
        async with Peaks(stack) as peaks:
            t0 = time.monotonic()
            tasks = []
            for i in range(count):
                await asyncio.sleep(max(0.0, t0 + i / offered - time.monotonic()))
                r = Result(job=make_job(spec, i, tokens))
                burst.append(r)
                tasks.append(asyncio.create_task(run.one(r.job, r)))
            await asyncio.gather(*tasks)
    finally:
        await _queue_limit(stack, None)
    peaks.fill(figures)
    rejected = [r for r in burst if r.status == 429]
    figures.rejected_429 = len(rejected)
    figures.p99_429_ms = p99([r.answer_s * 1000 for r in rejected])
    figures.p99_429_bridge_ms = p99([r.bridge_ms for r in rejected if r.bridge_ms is not None])
    ordered = sorted(r.answer_s * 1000 for r in rejected)
    median = ordered[len(ordered) // 2] if ordered else None
    figures.missing_retry_after = sum(1 for r in burst if r.status == 429 and not r.retry_after)
    figures.notes.append(
        f"sustainable {rate:.1f} req/s ({tokens} tokens each), offered {offered:.1f} req/s: {count} requests sent "
        f"at that rate (up to {spec.overload_seconds:.0f}s, at most {spec.overload_cap}) with work queues of "
        f"{spec.overload_queue} messages (the stack holds {holds}); "
        f"429 p50 {median or 0:.1f} ms at the client"
    )
    return await run.judge(figures, measured + burst)


RUNNERS = {"crash": crash, "nats-restart": nats_restart, "overload": overload}
