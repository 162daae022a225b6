"""NIXL tensor transport: one-sided READs over UCX from the holder's arena.

Why it looks the way it does:

- Registering memory is slow, and peers only see memory registered before
  they loaded our metadata. So each agent registers one arena (its byte
  budget) and one receive arena at start, publishes its metadata once in a
  JetStream KV bucket, and sub-allocates regions from the arenas.
- A READ is one-sided: the holder cannot refuse it, and a reader holding a
  stale ref would otherwise read whatever now lives at that address. So a
  reader first asks the holder for a lease over core NATS
  (``mmpipe.<ns>.tensor.<holder>``). The holder grants it only while the
  region is held and unclaimed, and then pins the region until the READ's
  notification comes back or the lease lapses. The reader accepts its bytes
  only if the READ completed within the lease, measured from before it sent
  the request, so the holder's lease (which starts later) still covered it.
  A reader can therefore never get another request's bytes. As a bonus the
  request tells a dead holder at once (no responders) instead of after a
  transfer timeout, and a ref is read at most once.
- A reader that already knows the holder posts its READ beside the lease
  request instead of after its reply (the round trip is ~0.5 ms over core
  NATS, as long as a whole 1 GB READ on one GPU). It names the lease itself
  (a random id) so the READ's notification can say which lease it is under,
  and keeps the bytes only if the lease is granted: a granted lease means
  the region was held, never freed and so never reused, from the ref's
  publication until the lease ends. A refused lease makes the READ's bytes
  garbage the reader drops; the holder's memory is only read, never written.
- A put of tensors on the arena's GPU returns once their copy is queued
  (behind the tower or the prefill that made them), not landed: the next
  hop's message then travels while the GPU finishes. Such a ref says
  ``landed=False``; its holder grants a lease only after the copy's CUDA
  event, and the reader posts its READ after that grant.
- The agent itself (its thread, UCX progress) is in ``nixl_agent.py``; the
  reader's side of a READ from another process (the lease, the holder's
  metadata, the READ) in ``nixl_reader.py``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import msgspec
import nats.errors
import nats.js.errors
import structlog
import torch
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from pipeline.streams import retrying
from pipeline.subjects import check_token
from pipeline.transport import metrics
from pipeline.transport.arena import FirstFit
from pipeline.transport.base import ForeignTensorRef, TargetTainted, TensorGone, TransportFull, TransportSettings
from pipeline.transport.copy import copy_bytes
from pipeline.transport.holder import Held, HeldRegions
from pipeline.transport.nixl_agent import Agent
from pipeline.transport.nixl_reader import NAME, RemoteReads, agent_bucket, lease_subject, new_lease
from pipeline.transport.packing import (
    Target,
    check_specs,
    check_targets,
    copy_into,
    layout,
    pack_into,
    pieces,
    target_runs,
    unpack,
)
from schemas.tensors import LeaseReply, LeaseRequest, TensorRef
from stages.compute_threads import helper_pool

log = structlog.get_logger(__name__)

__all__ = ["NAME", "NixlTransport", "agent_bucket", "lease_subject"]

# Copies queued on different streams may land out of order: a few waits at once.
_LANDING_THREADS = 4


class NixlTransport:
    """A NIXL agent (UCX backend) that holds tensors for readers and reads
    those of others. Memory lives on ``device`` (CPU: DRAM, cuda:N: VRAM)."""

    name = NAME

    def __init__(
        self,
        nc: Client,
        js: JetStreamContext,
        namespace: str,
        settings: TransportSettings | None = None,
        role: str = "worker",
        device: torch.device | str = "cpu",
    ) -> None:
        self._nc = nc
        self._js = js
        self._ns = check_token(namespace, "namespace")
        self.settings = settings or TransportSettings()
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.mem: Literal["DRAM", "VRAM"] = "VRAM" if self.device.type == "cuda" else "DRAM"
        self.device_id = self.device.index or 0
        # Unique per process start: a restarted holder is a new agent, so refs
        # to the old one fail cleanly instead of reaching new memory.
        safe_role = "".join(c if c.isalnum() or c in "-_" else "_" for c in role)
        self.agent_name = f"{safe_role}-{uuid.uuid4().hex[:12]}"
        self.last_transfer: tuple[int, float] = (0, 0.0)
        # Loads NIXL: raises TransportUnavailable when it is not installed.
        self._agent = Agent(self.agent_name, self.device, progress_thread=self.settings.progress_thread)
        self._reads = RemoteReads(nc, self._ns, self.settings, self._agent, self.mem)
        self._arena = torch.empty(0, dtype=torch.uint8)
        self._recv = torch.empty(0, dtype=torch.uint8)
        self._recv_alloc = FirstFit(0)
        self._recv_freed = asyncio.Event()
        # Receive regions kept out of use, with the timer that frees them (None: never).
        self._quarantined: dict[int, asyncio.TimerHandle | None] = {}
        self._held = HeldRegions(NAME, self.settings.budget_bytes, self.settings.ttl_s)
        # Storage registered to READ into (get_into), by address; kept alive until close.
        self._targets: dict[int, torch.Tensor] = {}
        self._kv: KeyValue | None = None
        self._sub: Any = None
        self._poller: asyncio.Task[None] | None = None
        # Lease requests waiting for their region's copy to land.
        self._landing_waits: set[asyncio.Task[None]] = set()
        # Threads that sleep in a blocking CUDA event's synchronize until a
        # put's copy has landed: woken by the driver as it ends (the event
        # loop's backed-off polling saw it up to 2 ms late, on every split
        # request's path). Made on the first wait: CPU holders never wait.
        self._landing_threads: ThreadPoolExecutor | None = None
        self._closed = False
        self._stopped = False

    # -- lifecycle -------------------------------------------------------

    async def start(self) -> None:
        s = self.settings
        # The arenas first: on CUDA this creates the context the agent's UCX needs.
        self._arena = torch.empty(s.budget_bytes, dtype=torch.uint8, device=self.device)
        recv_bytes = s.recv_bytes if s.recv_bytes is not None else s.budget_bytes
        self._recv = torch.empty(recv_bytes, dtype=torch.uint8, device=self.device)
        self._recv_alloc = FirstFit(recv_bytes)
        metadata = await self._agent.start([self._arena, self._recv])
        await self._publish_metadata(metadata)
        self._sub = await self._nc.subscribe(lease_subject(self._ns, self.agent_name), cb=self._on_lease)
        self._poller = asyncio.create_task(self._poll(), name=f"nixl-holder-{self.agent_name}")
        log.info("tensor_transport_started", transport=NAME, agent=self.agent_name, mem=self.mem, budget=s.budget_bytes)

    async def _bucket(self, bucket: str) -> Any:
        js = self._js
        try:
            return await js.key_value(bucket)
        except nats.js.errors.BucketNotFoundError:
            try:
                return await js.create_key_value(bucket=bucket, history=1, replicas=self.settings.replicas)
            except nats.js.errors.BadRequestError:
                return await js.key_value(bucket)  # another agent created it first

    async def _publish_metadata(self, metadata: bytes) -> None:
        """Peers cannot READ memory registered after they loaded our metadata:
        publish again after every registration."""
        bucket = agent_bucket(self._ns)
        self._kv = self._reads.kv = kv = await retrying(
            f"agent bucket {bucket}", lambda: self._bucket(bucket), timeout_s=60.0
        )
        # A bucket just created on a cluster may not answer from this node yet.
        await retrying(f"agent metadata in {bucket}", lambda: kv.put(self.agent_name, metadata), timeout_s=30.0)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._sub is not None:
            await self._sub.unsubscribe()  # no new leases from here on
        # A reader with a lease may be mid-READ: give it its lease time before the arena goes.
        deadline = time.monotonic() + self.settings.lease_s
        poller = self._poller
        while time.monotonic() < deadline:
            if not self._held.any_leased() or poller is None or poller.done():
                break
            await asyncio.sleep(0.01)
        self._stopped = True
        for task in self._landing_waits:
            task.cancel()
        if self._landing_threads is not None:
            self._landing_threads.shutdown(wait=False, cancel_futures=True)
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.wait([self._poller], timeout=5)
        self._held.clear()
        if self._kv is not None:
            try:
                await self._kv.delete(self.agent_name)
            except Exception as exc:
                metrics.ERRORS.labels(NAME, "unpublish").inc()
                log.warning("nixl_unpublish_failed", agent=self.agent_name, error=repr(exc))
        await self._agent.close()
        for timer in self._quarantined.values():
            if timer is not None:
                timer.cancel()

    # -- holder side -----------------------------------------------------

    @property
    def held_bytes(self) -> int:
        return self._held.used_bytes

    def has_room(self, nbytes: int = 0) -> bool:
        return self._held.has_room(nbytes)

    async def put(self, tensors: list[torch.Tensor], *, owner: str) -> TensorRef:
        t0 = time.monotonic()
        specs, nbytes = layout(tensors)
        held = await self._held.reserve(nbytes, owner=owner, wait_s=self.settings.put_wait_s)
        landed = True
        try:
            region = self._arena[held.offset : held.offset + nbytes]
            if self.device.type == "cuda" and all(t.device == self.device for t in tensors):
                # Queued behind the work that made the tensors (a vision
                # tower, a prefill): the ref goes out now, and the next hop's
                # message travels while the GPU finishes; a lease waits for
                # the landing instead (_on_lease).
                stream = torch.cuda.current_stream(self.device)
                with torch.cuda.stream(stream):
                    pack_into(region, tensors, specs)
                event = torch.cuda.Event(blocking=True)
                event.record(stream)
                if not event.query():
                    held.landing, landed = event, False
            else:
                devices = {self.device, *(t.device for t in tensors)}
                await copy_bytes(lambda: pack_into(region, tensors, specs), nbytes, *devices)
        except BaseException:
            self._held.free(held)
            raise
        self._held.publish(held)
        dt = time.monotonic() - t0
        self.last_transfer = (nbytes, dt)
        metrics.BYTES.labels(NAME, "put").inc(nbytes)
        return TensorRef(
            transport=NAME,
            holder=self.agent_name,
            key=held.key,
            addr=self._arena.data_ptr() + held.offset,
            nbytes=nbytes,
            mem=self.mem,
            device_id=self.device_id,
            tensors=specs,
            expires=held.expires,
            landed=landed,
        )

    async def release(self, ref: TensorRef) -> None:
        if ref.holder == self.agent_name:
            self._held.release(ref.key)

    async def release_owner(self, owner: str) -> int:
        return self._held.release_owner(owner)

    async def _on_lease(self, msg: Msg) -> None:
        try:
            req = msgspec.msgpack.decode(msg.data, type=LeaseRequest)
        except msgspec.DecodeError as exc:
            metrics.ERRORS.labels(NAME, "bad_lease_request").inc()
            log.warning("nixl_bad_lease_request", agent=self.agent_name, error=str(exc))
            reply = LeaseReply(reason="bad request")
        else:
            if req.abort:
                self._held.end_lease(req.key, req.lease, read=False)
                return
            held = self._held.get(req.key)
            if held is not None and held.landing is not None:
                # Answered from a task: a wait here would hold up every other reader's lease.
                task = asyncio.create_task(self._grant_when_landed(msg, held, req))
                self._landing_waits.add(task)
                task.add_done_callback(self._landing_waits.discard)
                return
            reply = self._grant(req.key, req.lease or new_lease())
        if msg.reply:
            await msg.respond(msgspec.msgpack.encode(reply))

    async def _grant_when_landed(self, msg: Msg, held: Held, req: LeaseRequest) -> None:
        """A lease asked for before the region's copy landed: granted once it
        has, or refused as ``landing`` (the reader asks again while its get
        may wait) before the reader's request would time out."""
        wait_s = req.wait_s or self.settings.request_timeout_s / 2
        if self._landing_threads is None:
            self._landing_threads = helper_pool("nixl-landing", _LANDING_THREADS)
        event = held.landing
        landed = event is None or event.query()
        if not landed:
            # A thread left waiting past the timeout ends with the copy, which the GPU finishes regardless.
            waited = asyncio.get_running_loop().run_in_executor(self._landing_threads, event.synchronize)
            try:
                await asyncio.wait_for(asyncio.shield(waited), wait_s)
                landed = True
            except TimeoutError:
                pass
        if landed:
            held.landing = None
            reply = self._grant(req.key, req.lease or new_lease())
        else:
            reply = LeaseReply(reason="landing")
        if msg.reply:
            try:
                await msg.respond(msgspec.msgpack.encode(reply))
            except Exception as exc:
                metrics.ERRORS.labels(NAME, "lease_reply").inc()
                log.warning("nixl_lease_reply_failed", agent=self.agent_name, key=req.key, error=repr(exc))

    def _grant(self, key: str, lease: int) -> LeaseReply:
        reason = self._held.lease(key, lease, self.settings.lease_s)
        if reason:
            return LeaseReply(reason=reason)
        return LeaseReply(lease=lease, lease_s=self.settings.lease_s)

    async def _poll(self) -> None:
        """Frees regions whose READ notification came back, whose lease lapsed
        after a read or release, or whose TTL passed."""
        while not self._stopped:
            try:
                if self._held.count:
                    notifs = await self._agent.notifications()
                    for reader, messages in notifs.items():
                        for message in messages:
                            key, _, lease = message.decode(errors="replace").partition(":")
                            if not self._held.end_lease(key, int(lease) if lease.isdigit() else -1, read=True):
                                log.debug("nixl_late_notif", reader=reader, key=key)
                    self._held.sweep()
                # Fast while a READ may be under way: without UCX's progress
                # thread this loop also drives the holder's side of the transfer.
                await self._held.nap(0.0005 if self._held.any_leased() else 0.02 if self._held.count else 1.0)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                metrics.ERRORS.labels(NAME, "poll").inc()
                log.exception("nixl_poll_failed", agent=self.agent_name, error=repr(exc))
                await asyncio.sleep(0.1)

    # -- reader side -----------------------------------------------------

    @property
    def last_read(self) -> tuple[int, float]:
        """The last remote READ alone (bytes, seconds): what UCX took, without
        the lease round trip and the copy out of the receive arena."""
        return self._reads.last_read

    @property
    def last_read_phases(self) -> dict[str, float]:
        return self._reads.last_read_phases

    def _check_ref(self, ref: TensorRef) -> None:
        if ref.transport != NAME:
            raise ValueError(f"a {ref.transport!r} tensor ref was given to the {NAME!r} transport")
        check_specs(ref.tensors, ref.nbytes)
        try:
            # The holder names a subject token and a key of this namespace's bucket: nothing else.
            check_token(ref.holder, "tensor holder")
        except ValueError as exc:
            metrics.ERRORS.labels(NAME, "foreign_ref").inc()
            raise ForeignTensorRef(str(exc)) from None
        if time.time() > ref.expires:
            metrics.ERRORS.labels(NAME, "expired_ref").inc()
            raise TensorGone(f"tensors {ref.key} of {ref.holder} expired before they were read")

    def _count(self, ref: TensorRef, t0: float) -> None:
        dt = time.monotonic() - t0
        self.last_transfer = (ref.nbytes, dt)
        metrics.BYTES.labels(NAME, "get").inc(ref.nbytes)
        metrics.TRANSFER_SECONDS.labels(NAME).observe(dt)

    async def get(self, ref: TensorRef, device: torch.device | str = "cpu") -> list[torch.Tensor]:
        t0 = time.monotonic()
        self._check_ref(ref)
        out = torch.empty(ref.nbytes, dtype=torch.uint8, device=device)
        if ref.holder == self.agent_name:
            await self._get_local(ref, lambda region: out.copy_(region), out.device)
        else:
            await self._get_remote(ref, out, deadline=t0 + self.settings.get_timeout_s)
        self._count(ref, t0)
        return unpack(out, ref.tensors)

    async def get_into(self, ref: TensorRef, targets: list[Target]) -> None:
        """READ the ref's tensors straight into ``targets``: tensors on this
        transport's device with the specs' dtypes and shapes, strided views
        allowed, or a tensor's pieces (the blocks of a paged KV cache, each
        run of bytes one descriptor). No receive arena, no copy after the
        READ. Raises ``TargetTainted`` when a READ could not be cancelled:
        the targets may still be written and must not be reused."""
        t0 = time.monotonic()
        self._check_ref(ref)
        check_targets(targets, ref.tensors, self.device)
        if ref.holder == self.agent_name:

            def copy(region: torch.Tensor) -> None:
                for target, view in zip(targets, unpack(region, ref.tensors), strict=True):
                    copy_into(target, view)

            await self._get_local(ref, copy, self.device)
        else:
            await self._register_targets(targets)
            local, remote = [], []
            for target, spec in zip(targets, ref.tensors, strict=True):
                for address, n, offset in target_runs(target):
                    local.append((address, n, self.device_id))
                    remote.append((ref.addr + spec.offset + offset, n, ref.device_id))
            tainted = False

            def taint(forever: bool) -> None:
                nonlocal tainted
                tainted = True  # the caller's memory cannot be quarantined for a while: for good

            try:
                await self._reads.read(ref, local, remote, t0 + self.settings.get_timeout_s, tainted=taint)
            except TensorGone as exc:
                if tainted:
                    raise TargetTainted(f"{exc}; the targets may still be written") from exc
                raise
        self._count(ref, t0)

    async def _register_targets(self, targets: list[Target]) -> None:
        """Register the whole storage under each target once (a KV cache:
        at its first hand-off); it stays registered until close."""
        for target in (piece for t in targets for piece in pieces(t)):
            storage = target.untyped_storage()
            if storage.data_ptr() in self._targets or not storage.nbytes():
                continue
            whole = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)
            await self._agent.register([whole])
            self._targets[storage.data_ptr()] = whole

    async def _get_local(self, ref: TensorRef, copy: Callable[[torch.Tensor], object], to: torch.device) -> None:
        """A worker that runs two steps reads its own tensors without NIXL."""
        lease = new_lease()
        reason = self._held.lease(ref.key, lease, self.settings.lease_s)
        if reason:
            raise TensorGone(f"tensors {ref.key} are no longer held here ({reason})")
        held = self._held.get(ref.key)
        assert held is not None
        try:
            region = self._arena[held.offset : held.offset + ref.nbytes]
            await copy_bytes(lambda: copy(region), ref.nbytes, self.device, to)
        finally:
            self._held.end_lease(ref.key, lease, read=True)

    async def _get_remote(self, ref: TensorRef, out: torch.Tensor, deadline: float) -> None:
        n = max(ref.nbytes, 1)  # NIXL rejects empty descriptors; a held region is never empty
        offset = await self._reserve_recv(n, deadline)
        try:
            local = [(self._recv.data_ptr() + offset, n, self.device_id)]
            remote = [(ref.addr, n, ref.device_id)]

            def quarantine(forever: bool) -> None:
                self._quarantine(offset, forever=forever)

            await self._reads.read(ref, local, remote, deadline, tainted=quarantine)
            recv = self._recv[offset : offset + ref.nbytes]
            await copy_bytes(lambda: out.copy_(recv), ref.nbytes, self.device, out.device)
        finally:
            if offset not in self._quarantined:
                self._free_recv(offset)

    def _free_recv(self, offset: int) -> None:
        self._quarantined.pop(offset, None)
        self._recv_alloc.free(offset)
        self._recv_freed.set()

    def _quarantine(self, offset: int, *, forever: bool) -> None:
        """Keep a receive region out of use: a READ we gave up on may still write into it."""
        timer = self._quarantined.get(offset)
        if timer is not None:
            timer.cancel()
        later = asyncio.get_running_loop().call_later
        self._quarantined[offset] = None if forever else later(self.settings.lease_s, self._free_recv, offset)

    async def _reserve_recv(self, n: int, deadline: float) -> int:
        if self._recv_alloc.region_size(n) > self._recv_alloc.size:
            raise TransportFull(f"{n} bytes do not fit this reader's receive arena of {self._recv_alloc.size} bytes")
        while (offset := self._recv_alloc.alloc(n)) is None:
            self._recv_freed.clear()
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    await self._recv_freed.wait()
            except TimeoutError:
                raise TransportFull(f"no room for {n} bytes in the receive arena within the get timeout") from None
        return offset
