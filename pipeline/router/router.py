"""The KV router: sends a hop that prefills to the worker whose prefix
cache holds most of its prompt, weighed against that worker's load, as
NVIDIA Dynamo's KV router does; else to the shared queue.

It hears every worker's KV events (relayed on ``mmpipe.<ns>.kv_events.*``)
and load (``mmpipe.<ns>.load.*``). A worker's cost for a request is
``overlap_weight * blocks it would prefill + KV blocks it would then hold``
(what it reported, what was sent to it since, and what this prefill adds); the cheapest wins
(where one holds some of the prompt, a worker that holds none may be
cheapest for its load: it gets the hop). A prompt cached nowhere goes to
the shared queue, where whichever worker is free first takes it. A worker at its
in-flight cap, draining, or not heard from for ``worker_silent_s`` is not
sent to.

Nothing sent is lost: a worker gives back what it does not start within
``routed_wait_s`` and what it holds when it stops (pipeline/worker.py);
for a worker that is gone, the rescuer here moves what waits on its
subject back to the shared queue, once the worker's own consumer is
gone (JetStream lets one consumer at a time filter a subject of a work
queue, which makes the move exclusive).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass
from typing import Any, Final

import msgspec
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import APIError, NotFoundError
from prometheus_client import Counter

from pipeline.config import PipelineConfig
from pipeline.router.index import PrefixIndex
from pipeline.router.requeue import requeue
from schemas.control import EmbeddingsHeld, WorkerLoad
from schemas.kv_events import KVEventBatch
from schemas.processed import ProcessedRequest
from stages.media import media_set_key
from stages.media.inline import inline_digest
from stages.prefix_keys import PromptMedia, prompt_block_keys

log = structlog.get_logger(__name__)

DECISIONS: Final = Counter(
    "mmpipe_router_decisions_total",
    "Hops the KV router placed: on one worker (its prefix cached there) or on the shared queue",
    ["role", "to"],
)
ROUTED_HIT_BLOCKS: Final = Counter(
    "mmpipe_router_overlap_blocks_total", "Prompt blocks the chosen workers held, as the router saw them", ["role"]
)

# JetStream: a work queue's consumers may not filter the same subject.
_FILTER_TAKEN = 10100
_RESCUE_EVERY_S = 1.0


ENCODE = "encode"
# A worker silent this many times worker_silent_s is forgotten (what it held, its load).
_FORGET_AFTER = 20


# How long the choices of one prompt follow the first one's worker.
_GROUP_PIN_S = 10.0


def routable(role: str) -> bool:
    """Hops worth sending to a worker with the prompt's prefix: those that prefill."""
    return "prefill" in role.split("+")


@dataclass
class _Worker:
    load: WorkerLoad
    seen: float
    # Blocks of the requests sent to it since its last report.
    sent_blocks: int = 0

    @property
    def busy(self) -> int:
        return self.load.inflight + self.load.waiting


class KvRouter:
    def __init__(self, nc: Client, js: JetStreamContext, config: PipelineConfig) -> None:
        self.nc = nc
        self.js = js
        self.config = config
        self.settings = config.router
        self.subjects = config.subjects
        self.index = PrefixIndex()
        self.workers: dict[str, _Worker] = {}
        # Every role a worker was heard of: their queues are where hops may wait for the gone.
        self.roles: set[str] = set()
        self._subs: list[Any] = []
        self._rescuer: asyncio.Task[None] | None = None
        # Media sets (media_set_key) -> the encoding workers holding their embeddings.
        self.embeddings: dict[str, set[str]] = {}
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._load_decoder = msgspec.msgpack.Decoder(WorkerLoad)
        self._held_decoder = msgspec.msgpack.Decoder(EmbeddingsHeld)
        # The n choices of a prompt (a ChoiceGroup) -> the worker its first
        # went to, and until when its others follow: one worker takes them
        # all, and prefills the prompt once for them.
        self._groups: dict[str, tuple[str, float]] = {}

    async def start(self) -> None:
        self._subs = [
            await self.nc.subscribe(self.subjects.all_kv_events, cb=self._on_events),
            await self.nc.subscribe(self.subjects.all_loads, cb=self._on_load),
            await self.nc.subscribe(self.subjects.all_embeddings, cb=self._on_embeddings),
        ]
        self._rescuer = asyncio.create_task(self._rescue_loop())
        log.info("kv_router_started", overlap_weight=self.settings.overlap_weight)

    async def close(self) -> None:
        if self._rescuer is not None:
            self._rescuer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._rescuer
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    # -- what the workers say ---------------------------------------------

    async def _on_events(self, msg: Msg) -> None:
        worker = msg.subject.rsplit(".", 1)[-1]
        try:
            batch = self._decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("kv_events_undecodable", worker_id=worker, error=repr(exc))
            return
        self.index.apply(worker, batch.events)

    async def _on_embeddings(self, msg: Msg) -> None:
        worker = msg.subject.rsplit(".", 1)[-1]
        try:
            held = self._held_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("embeddings_undecodable", worker_id=worker, error=repr(exc))
            return
        for media in held.stored:
            self.embeddings.setdefault(media, set()).add(worker)
        for media in held.removed:
            holders = self.embeddings.get(media)
            if holders is not None:
                holders.discard(worker)
                if not holders:
                    del self.embeddings[media]

    def forget(self, worker: str) -> None:
        """A worker long gone: nothing it held is there any more."""
        self.workers.pop(worker, None)
        self.index.forget(worker)
        for media in [m for m, holders in self.embeddings.items() if worker in holders]:
            self.embeddings[media].discard(worker)
            if not self.embeddings[media]:
                del self.embeddings[media]

    async def _on_load(self, msg: Msg) -> None:
        try:
            load = self._load_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("worker_load_undecodable", subject=msg.subject, error=repr(exc))
            return
        self.heard(load)

    def heard(self, load: WorkerLoad) -> None:
        """A worker's load report: it is alive, this busy."""
        self.workers[load.worker_id] = _Worker(load, time.monotonic())
        self.roles.add(load.role)

    def alive(self, worker_id: str) -> bool:
        w = self.workers.get(worker_id)
        return w is not None and time.monotonic() - w.seen < self.settings.worker_silent_s

    # -- where a hop goes ---------------------------------------------------

    def place(self, out: ProcessedRequest) -> tuple[str, ProcessedRequest]:
        """Where ``out`` goes, and as what: a request for the encode hop
        whose media's tokens a worker of the next hop holds in its prefix
        cache goes to that worker past the encode hop (as vLLM skips the
        encoder for media its prefix cache covers); anything else as
        ``subject_for`` says."""
        # Known before this prompt's blocks are stored: its media's token counts are learned from them.
        for m in out.media:
            self.index.placeholders.add(out.prompt_token_ids[m.placeholder_index])
        if out.hop == ENCODE and (skipped := self._skip_encode(out)) is not None:
            return skipped
        return self.subject_for(out), out

    def subject_for(self, out: ProcessedRequest) -> str:
        """The subject ``out`` is published to: a worker's own, or its hop's shared one."""
        role = out.hop
        if role == ENCODE:
            worker = self.choose_encoder(out)
        elif routable(role) and out.request.group is not None and out.request.group.size > 1:
            worker = self.choose_for_group(out, out.request.group.id)
        else:
            worker = self.choose(out) if routable(role) else None
        DECISIONS.labels(role, "worker" if worker else "shared").inc()
        if worker is None:
            return self.subjects.work(role)
        return self.subjects.routed(role, worker)

    def _takers(self, role: str) -> dict[str, _Worker]:
        """The workers of ``role`` a hop may be sent to: heard from, not stopping, a slot free."""
        now = time.monotonic()
        return {
            wid: w
            for wid, w in self.workers.items()
            if w.load.role == role
            and now - w.seen < self.settings.worker_silent_s
            and not w.load.draining
            and w.busy < w.load.max_inflight
        }

    def choose_encoder(self, out: ProcessedRequest) -> str | None:
        """The least busy encode worker that holds the embeddings of ``out``'s
        media (all of them inline: a URL's bytes are its encoder's to read)."""
        digests = [inline_digest(out, i) for i in range(len(out.media))]
        if not digests or not all(digests):
            return None
        holders = self.embeddings.get(media_set_key(digests), set())
        takers = [(w, c) for w, c in self._takers(out.hop).items() if w in holders]
        if not takers:
            return None
        wid, best = min(takers, key=lambda t: (t[1].busy + t[1].sent_blocks, random.random()))
        best.sent_blocks += 1
        return wid

    def choose_for_group(self, out: ProcessedRequest, group: str) -> str | None:
        """Where a choice of ``group`` goes: where its first one went, while
        that worker takes hops; the first goes where ``choose`` says or,
        its prompt cached nowhere, to the least busy worker (not the shared
        queue: the others must know where to follow)."""
        now = time.monotonic()
        for gone in [g for g, (_, until) in self._groups.items() if until < now]:
            del self._groups[gone]
        takers = self._takers(out.hop)
        pinned = self._groups.get(group)
        if pinned is not None and pinned[0] in takers:
            return pinned[0]
        worker = self.choose(out)
        if worker is None and takers:
            worker = min(takers, key=lambda wid: (takers[wid].busy + takers[wid].sent_blocks, random.random()))
            takers[worker].sent_blocks += 1
        if worker is not None:
            # Long enough for the others, published with it, to follow.
            self._groups[group] = (worker, now + _GROUP_PIN_S)
        return worker

    def choose(self, out: ProcessedRequest) -> str | None:
        role = out.hop
        # Known before this prompt's blocks are stored: its media's runs are learned from them.
        for m in out.media:
            self.index.placeholders.add(out.prompt_token_ids[m.placeholder_index])
        candidates = self._takers(role)
        sizes = [self.index.block_sizes[wid] for wid in candidates if wid in self.index.block_sizes]
        if not sizes:
            return None  # no worker of the role tells what it caches
        keys = self.prompt_keys(out, sizes[0])
        overlaps = self.index.overlaps(keys)
        if not any(overlaps.get(wid) for wid in candidates):
            log.debug("kv_cached_nowhere", request_id=out.request.request_id, keys=len(keys), workers=len(candidates))
            return None  # cached nowhere: whichever worker is free first takes it
        return self._cheapest(out, candidates, overlaps, _prompt_blocks(out, keys, sizes[0]))

    def _cheapest(
        self, out: ProcessedRequest, candidates: dict[str, _Worker], overlaps: dict[str, int], blocks: int
    ) -> str:
        """The worker of ``candidates`` a prompt of ``blocks`` blocks costs least on, counted as sent to it."""

        def cost(item: tuple[str, _Worker]) -> tuple[float, float]:
            wid, w = item
            new = blocks - overlaps.get(wid, 0)
            active = w.load.active_blocks if w.load.total_blocks else w.busy * blocks
            # Its blocks once it runs there: what it prefills adds to them,
            # what it finds cached is (as a running turn's prefix) already in.
            potential = active + w.sent_blocks + new
            # Ties broken at random: equal workers share the load.
            return self.settings.overlap_weight * new + potential, random.random()

        wid, best = min(candidates.items(), key=cost)
        log.debug(
            "kv_routed",
            request_id=out.request.request_id,
            worker_id=wid,
            blocks=blocks,
            overlaps={w: overlaps.get(w, 0) for w in candidates},
            costs={w: round(cost((w, c))[0]) for w, c in candidates.items()},
        )
        best.sent_blocks += blocks
        ROUTED_HIT_BLOCKS.labels(out.hop).inc(overlaps.get(wid, 0))
        return wid

    def _skip_encode(self, out: ProcessedRequest) -> tuple[str, ProcessedRequest] | None:
        """The next hop's subject on a worker whose prefix cache holds every
        token of ``out``'s media, and the message for it; None where none
        does (or may be sent one: a worker that does not take such requests,
        the n choices of a prompt, media the processor decoded, whose copy
        only an encoder reads, a request run again)."""
        group = out.request.group
        if not out.media or out.decoded is not None or out.hop_index + 1 >= len(out.route):
            return None
        if out.attempt > 0:
            return None  # a request run again (what a hop needed was gone) takes every hop
        if group is not None and group.size > 1:
            return None
        skipped = out.skipping_encode()
        role = skipped.hop
        if not routable(role):
            return None
        candidates = {w: c for w, c in self._takers(role).items() if c.load.takes_cached_media}
        sizes = [self.index.block_sizes[wid] for wid in candidates if wid in self.index.block_sizes]
        if not sizes:
            return None
        keys, media = self._prompt_keys(skipped, sizes[0])
        end = _media_end(media)
        if end is None:
            return None
        overlaps = self.index.overlaps(keys)
        # Blocks that must be cached: those up to the last media token's.
        covering = -(-end // sizes[0])
        holders = {wid: w for wid, w in candidates.items() if overlaps.get(wid, 0) >= covering}
        if not holders:
            return None
        wid = self._cheapest(skipped, holders, overlaps, _prompt_blocks(skipped, keys, sizes[0]))
        DECISIONS.labels(ENCODE, "skipped").inc()
        DECISIONS.labels(role, "worker").inc()
        return self.subjects.routed(role, wid), skipped

    def prompt_keys(self, out: ProcessedRequest, block_size: int) -> list[int]:
        """The engine's keys of ``out``'s prompt blocks, as far as the router
        can know them: each media item's digest from its inline bytes (or
        from its encoding), its token count from the encoding or, tried in
        turn, from the lengths the index has seen. None for a prompt given
        as embeddings: its ids are stand-ins, no worker caches it."""
        return self._prompt_keys(out, block_size)[0]

    def _prompt_keys(self, out: ProcessedRequest, block_size: int) -> tuple[list[int], list[PromptMedia]]:
        """``prompt_keys``, and each media item as they were made with (its
        token count None where none was found)."""
        if out.request.prompt_embeds is not None or out.lora:
            # (An adapter's blocks are keyed apart from the base model's: not indexed here yet.)
            return [], []
        prompt = out.prompt_token_ids
        encoded = out.encoded.items if out.encoded is not None else None
        media: list[PromptMedia] = []
        for i, m in enumerate(out.media):
            if encoded is not None:
                media.append(PromptMedia(m.placeholder_index, encoded[i].num_tokens, encoded[i].digest))
            else:
                media.append(PromptMedia(m.placeholder_index, None, inline_digest(out, i)))
        best = prompt_block_keys(prompt, media, block_size)
        # Each unknown token count in turn: the seen length that matches the longest cached run.
        for i, pm in enumerate(media):
            if pm.num_tokens is not None or not pm.digest:
                continue
            tried: list[tuple[int, list[int], int]] = []
            for n in self.index.lengths(prompt[pm.placeholder_index]):
                media[i] = pm._replace(num_tokens=n)
                keys = prompt_block_keys(prompt, media, block_size)
                tried.append((max(self.index.overlaps(keys).values(), default=0), keys, n))
            if not tried:
                break
            held, keys, n = max(tried, key=lambda t: t[0])
            if held <= len(best):
                media[i] = pm
                break
            media[i] = pm._replace(num_tokens=n)
            best = keys
        return best, media

    # -- what waits for a worker that is gone -------------------------------

    async def _rescue_loop(self) -> None:
        while True:
            await asyncio.sleep(_RESCUE_EVERY_S)
            try:
                await self.rescue()
            except Exception as exc:  # the next round tries again
                log.warning("routed_rescue_failed", error=repr(exc))

    async def rescue(self) -> int:
        """Move what waits on the subjects of workers gone silent back to
        their shared queues; how many messages moved."""
        moved = 0
        now = time.monotonic()
        for wid in [w for w, s in self.workers.items() if now - s.seen > _FORGET_AFTER * self.settings.worker_silent_s]:
            self.forget(wid)
        for role in sorted(self.roles):
            stream = self.subjects.stream(role)
            try:
                info = await self.js.stream_info(stream, subjects_filter=self.subjects.all_routed(role))
            except NotFoundError:
                continue
            for subject, count in (info.state.subjects or {}).items():
                worker = subject.rsplit(".", 1)[-1]
                if count and not self.alive(worker):
                    moved += await self._rescue(role, worker)
        return moved

    async def _rescue(self, role: str, worker: str) -> int:
        stream = self.subjects.stream(role)
        name = f"rescue-{self.subjects.routed_durable(role, worker)}"
        cfg = ConsumerConfig(
            durable_name=name,
            filter_subject=self.subjects.routed(role, worker),
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=30.0,
            inactive_threshold=30.0,
        )
        try:
            await self.js.add_consumer(stream, cfg)
        except APIError as exc:
            if exc.err_code != _FILTER_TAKEN:
                raise
            # Its own consumer outlives a dead worker by orphan_after_s; one
            # silent this long is gone: free the subject now.
            with contextlib.suppress(NotFoundError):
                await self.js.delete_consumer(stream, self.subjects.routed_durable(role, worker))
            log.warning("routed_consumer_removed", role=role, worker_id=worker)
            return 0
        moved = 0
        sub = await self.js.pull_subscribe_bind(name, stream)
        try:
            while True:
                try:
                    msgs = await sub.fetch(64, timeout=0.2)
                except (TimeoutError, NatsTimeoutError):
                    break
                for msg in msgs:
                    await requeue(self.js, self.subjects, role, msg, "rescued")
                    moved += 1
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            with contextlib.suppress(Exception):
                await self.js.delete_consumer(stream, name)
        if moved:
            log.warning("routed_hops_rescued", role=role, worker_id=worker, moved=moved)
        return moved


def _media_end(media: list[PromptMedia]) -> int | None:
    """The position after the last media token in the expanded prompt; None
    where an item's token count or digest is not known."""
    end = shift = 0
    for m in media:
        if m.num_tokens is None or not m.digest:
            return None
        end = m.placeholder_index + shift + m.num_tokens
        shift += m.num_tokens - 1
    return end


def _prompt_blocks(out: ProcessedRequest, keys: list[int], block_size: int) -> int:
    """The KV blocks the prompt takes (at least one)."""
    return max(1, -(-_prompt_length(out, keys, block_size) // block_size))


def _prompt_length(out: ProcessedRequest, keys: list[int], block_size: int) -> int:
    return max(len(out.prompt_token_ids), len(keys) * block_size)
