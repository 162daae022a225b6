"""The reader's side of a NIXL READ from another process: the lease over
core NATS, the holder's agent metadata (loaded once, loaded again after a
failed transfer), and the READ itself, whose bytes count only if it
completed within the lease (why leases, and why a READ of a known holder
goes out beside its lease request: ``nixl.py``)."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final, Literal

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client
from nats.js.kv import KeyValue

from pipeline import tracing
from pipeline.transport import metrics
from pipeline.transport.base import ForeignTensorRef, TensorGone, TransportSettings
from pipeline.transport.nixl_agent import Agent, Desc
from schemas.tensors import LeaseReply, LeaseRequest, TensorRef

log = structlog.get_logger(__name__)

NAME: Final = "nixl"
# A reader trusts a lease for this share of its length: slack for clock drift
# between hosts and for the holder noticing the lapse a little early.
_LEASE_TRUST = 0.9


# Less time than this left in a get: another lease request could not be answered.
_MIN_ASK_S = 0.01


def new_lease() -> int:
    """A lease id: random, so a reader can name its lease before the holder
    answers, and two readers' ids never meet; never 0 (the holder picks)."""
    return secrets.randbits(62) + 1


def agent_bucket(namespace: str) -> str:
    return f"MMPIPE_{namespace}_AGENTS"


def lease_subject(namespace: str, holder: str) -> str:
    return f"mmpipe.{namespace}.tensor.{holder}"


@dataclass
class _Remote:
    inflight: int = 0
    # Set after a failed transfer: reload its metadata once nobody uses it.
    stale: bool = False


class RemoteReads:
    """READs of other agents' regions for one transport (its agent, its
    namespace); ``kv`` is the namespace's agent bucket, set once the
    transport has published its own metadata there."""

    def __init__(
        self, nc: Client, namespace: str, settings: TransportSettings, agent: Agent, mem: Literal["DRAM", "VRAM"]
    ) -> None:
        self._nc = nc
        self._ns = namespace
        self._settings = settings
        self._agent = agent
        self._mem = mem
        self.kv: KeyValue | None = None
        self._remotes: dict[str, _Remote] = {}
        # The last READ alone (bytes, seconds): what UCX took, without the
        # lease round trip and any copy after it; and its phases.
        self.last_read: tuple[int, float] = (0, 0.0)
        self.last_read_phases: dict[str, float] = {}

    async def read(
        self, ref: TensorRef, local: list[Desc], remote: list[Desc], deadline: float, tainted: Callable[[bool], None]
    ) -> None:
        """READ ``remote`` (the ref's region, as descriptors) into ``local``
        under a lease, by ``deadline``. ``tainted(forever)``: the local memory
        must stay out of use (a READ we gave up on may still write it)."""
        lease = new_lease()
        peer = self._remotes.get(ref.holder)
        claim: asyncio.Future[tuple[int, float]]
        if peer is not None and not peer.stale and ref.landed:
            # A holder we READ from before: the lease request and the READ go out together.
            claim = asyncio.ensure_future(self.claim(ref, deadline, lease))
            await asyncio.sleep(0)  # the request leaves first: its round trip is the longer
        else:
            # The lease first: it tells a dead holder at once, before UCX tries to connect to it.
            claim = asyncio.get_running_loop().create_future()
            claim.set_result(await self.claim(ref, deadline, lease))
            try:
                peer = await self._ensure_remote(ref.holder, deadline)
            except TensorGone:
                await self._abort_lease(ref, lease)
                raise
        peer.inflight += 1
        try:
            t0 = time.monotonic()
            await self._read(ref, local, remote, lease, claim, deadline, tainted, peer)
            self.last_read = (sum(d[1] for d in local), time.monotonic() - t0)
        finally:
            peer.inflight -= 1
            if not claim.done():
                claim.cancel()
            # Retrieved (or it would be logged as never retrieved): a READ that raised left before awaiting it.
            claim.add_done_callback(lambda c: c.cancelled() or c.exception())

    async def _ensure_remote(self, holder: str, deadline: float) -> _Remote:
        remote = self._remotes.get(holder)
        if remote is not None and (not remote.stale or remote.inflight):
            return remote
        if remote is not None:
            # The holder may have died or re-registered: forget it, load it afresh.
            del self._remotes[holder]
            await self._agent.forget(holder)
        kv = self.kv
        assert kv is not None
        while True:
            try:
                timeout = min(self._settings.request_timeout_s, max(0.001, deadline - time.monotonic()))
                entry = await asyncio.wait_for(kv.get(holder), timeout)
                break
            except nats.js.errors.NotFoundError:
                metrics.ERRORS.labels(NAME, "holder_unknown").inc()
                raise TensorGone(f"tensor holder {holder} is gone (no agent metadata)") from None
            except TimeoutError:
                metrics.ERRORS.labels(NAME, "metadata_timeout").inc()
                # The bucket may be electing a leader (a NATS node lost): that
                # says nothing of the holder, whose tensors a restart of the
                # request would make again. Asked again while the get may wait.
                if deadline - time.monotonic() < _MIN_ASK_S:
                    raise TensorGone(f"metadata of tensor holder {holder} did not arrive in time") from None
        if entry.value is None:
            raise TensorGone(f"tensor holder {holder} is gone (empty agent metadata)")
        try:
            loaded = await self._agent.connect(entry.value)
        except Exception as exc:
            # NIXL connects while loading: an unreachable holder fails here.
            metrics.ERRORS.labels(NAME, "add_remote_failed").inc()
            log.warning("nixl_add_remote_failed", holder=holder, error=repr(exc))
            raise TensorGone(f"tensor holder {holder} is unreachable: {exc!r}") from None
        if loaded != holder:
            raise TensorGone(f"agent metadata under {holder} names agent {loaded!r}")
        remote = self._remotes[holder] = _Remote()
        return remote

    async def claim(self, ref: TensorRef, deadline: float, lease: int) -> tuple[int, float]:
        with tracing.tracer().start_as_current_span("lease", attributes={"holder": ref.holder}):
            return await self._claim(ref, deadline, lease)

    async def _claim(self, ref: TensorRef, deadline: float, lease: int) -> tuple[int, float]:
        """Ask the holder to pin the region under ``lease``; returns the lease
        id and the monotonic time until which a completed READ can be trusted
        (a READ posted after this call began)."""
        landing = False
        while True:
            sent = time.monotonic()
            reply = await self._ask(ref, deadline, lease, sent)
            if reply is None:
                # No answer, though the holder's subscription is there (a gone
                # holder has none: no responders): the request or its answer
                # may have been lost with a NATS node, or the holder paused.
                # Asked again while the get may wait; a holder that did grant
                # this lease grants it again, pinned from the new request on.
                if deadline - time.monotonic() < _MIN_ASK_S:
                    if landing:  # what the holder last said is the reason, not the last ask's silence
                        metrics.ERRORS.labels(NAME, "lease_landing").inc()
                        raise TensorGone(f"tensors {ref.key} of {ref.holder} were still landing at the get's deadline")
                    raise TensorGone(f"tensor holder {ref.holder} did not answer by the get's deadline")
                continue
            # The holder's GPU has not finished the copy yet: ask again while the get may wait.
            landing = reply.reason == "landing"
            if not landing or deadline - time.monotonic() < _MIN_ASK_S:
                break
        if not reply.lease:
            metrics.ERRORS.labels(NAME, f"lease_{reply.reason or 'refused'}").inc()
            raise TensorGone(f"tensors {ref.key} of {ref.holder} cannot be read ({reply.reason})")
        if reply.lease != lease:
            metrics.ERRORS.labels(NAME, "bad_lease_reply").inc()
            raise TensorGone(f"tensor holder {ref.holder} granted lease {reply.lease}, not the {lease} asked for")
        return reply.lease, sent + reply.lease_s * _LEASE_TRUST

    async def _ask(self, ref: TensorRef, deadline: float, lease: int, sent: float) -> LeaseReply | None:
        """The holder's reply; None when none came in time."""
        timeout = min(self._settings.request_timeout_s, max(0.001, deadline - sent))
        payload = msgspec.msgpack.encode(LeaseRequest(key=ref.key, lease=lease, wait_s=timeout * 0.75))
        try:
            msg = await self._nc.request(lease_subject(self._ns, ref.holder), payload, timeout=timeout)
        except nats.errors.NoRespondersError:
            await self._refuse_foreign(ref.holder)
            metrics.ERRORS.labels(NAME, "holder_gone").inc()
            raise TensorGone(f"tensor holder {ref.holder} is gone") from None
        except nats.errors.TimeoutError:
            metrics.ERRORS.labels(NAME, "lease_timeout").inc()
            log.warning("nixl_lease_unanswered", holder=ref.holder, key=ref.key, timeout_s=round(timeout, 3))
            return None
        try:
            return msgspec.msgpack.decode(msg.data, type=LeaseReply)
        except msgspec.DecodeError as exc:
            metrics.ERRORS.labels(NAME, "bad_lease_reply").inc()
            raise TensorGone(f"tensor holder {ref.holder} sent a bad lease reply: {exc}") from None

    async def _refuse_foreign(self, holder: str) -> None:
        """Nobody answers for ``holder`` on this namespace's lease subject. A
        holder that died or closed has (or had) metadata in the namespace's
        bucket; one that never had is no agent of this namespace: refuse the
        ref (not retryable) instead of treating it as a lost tensor."""
        assert self.kv is not None
        try:
            await asyncio.wait_for(self.kv.get(holder), self._settings.request_timeout_s)
        except nats.js.errors.NotFoundError as exc:
            if getattr(exc, "entry", None) is not None or getattr(exc, "op", None):
                return  # a delete marker: an agent of ours that closed
            metrics.ERRORS.labels(NAME, "foreign_ref").inc()
            raise ForeignTensorRef(
                f"tensor holder {holder} is not an agent of namespace {self._ns!r} (it never published metadata "
                f"in {agent_bucket(self._ns)}): a tensor ref is accepted only from this namespace's agents"
            ) from None
        except TimeoutError:
            return

    async def _read(
        self,
        ref: TensorRef,
        local: list[Desc],
        remote: list[Desc],
        lease: int,
        claim: Awaitable[tuple[int, float]],
        deadline: float,
        tainted: Callable[[bool], None],
        peer: _Remote,
    ) -> None:
        """READ the region into ``local``; the bytes count only if ``claim``
        grants the lease and the READ completed within it. ``tainted(forever)``
        keeps the local memory out of use when a READ we gave up on may still
        write it."""
        notif = f"{ref.key}:{lease}".encode()
        with tracing.tracer().start_as_current_span("read", attributes={"bytes": ref.nbytes, "holder": ref.holder}):
            outcome = await self._agent.read(local, self._mem, remote, ref.mem, ref.holder, notif, deadline)
        self.last_read_phases = outcome.phases
        if outcome.state != "DONE":
            peer.stale = True  # the holder may have died or re-registered: reload its metadata
        try:
            _, trusted_until = await claim
        except TensorGone:
            # No lease: whatever the READ wrote is not this ref's bytes.
            if not outcome.released:
                metrics.ERRORS.labels(NAME, "xfer_not_cancelled").inc()
                tainted(True)
            raise
        if outcome.state == "DONE" and outcome.ended < trusted_until:
            return
        if not outcome.released:
            metrics.ERRORS.labels(NAME, "xfer_not_cancelled").inc()
            tainted(True)
        elif outcome.state == "PROC":
            tainted(False)  # cancelled, but keep it out of use a while anyway
        if not outcome.posted:
            await self._abort_lease(ref, lease)  # no READ touched the region: another reader may have it now
        metrics.ERRORS.labels(NAME, "read_" + outcome.state.lower()).inc()
        log.warning("nixl_read_failed", holder=ref.holder, key=ref.key, state=outcome.state, error=outcome.error)
        ended = "completed after its lease ran out" if outcome.state == "DONE" else f"ended {outcome.state}"
        raise TensorGone(f"READ of {ref.key} from {ref.holder} {ended} {outcome.error}".rstrip())

    async def _abort_lease(self, ref: TensorRef, lease: int) -> None:
        try:
            payload = msgspec.msgpack.encode(LeaseRequest(key=ref.key, abort=True, lease=lease))
            await self._nc.publish(lease_subject(self._ns, ref.holder), payload)
        except Exception as exc:
            log.warning("nixl_lease_abort_failed", holder=ref.holder, key=ref.key, error=repr(exc))
