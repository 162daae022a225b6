"""NATS object-store tensor transport: the fallback for hosts without NIXL.

The packed bytes go to the JetStream object store (bucket
``MMPIPE_<ns>_TENSORS``, object name = key) and ride NATS in chunks, so the
server's max_payload does not limit them. A reader gets the object and then
deletes it: the delete is the release. The bucket has a TTL, so an object
nobody read vanishes even when its holder died. The data lives in the server,
not the holder: unlike NIXL, a ref stays readable after its holder dies.

The holder counts the bytes it put and has not seen deleted against its
budget. It learns of deletes by watching the bucket, and when put finds no
room it also checks the objects it still counts, in case the watch missed one.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Final

import nats.errors
import nats.js.errors
import structlog
import torch
from nats.aio.client import Client
from nats.js import JetStreamContext, api
from nats.js.object_store import ObjectStore

from pipeline.streams import retrying
from pipeline.subjects import check_token
from pipeline.transport import metrics
from pipeline.transport.base import TensorGone, TransportFull, TransportSettings
from pipeline.transport.copy import copy_bytes
from pipeline.transport.packing import Target, check_specs, check_targets, copy_into, layout, pack_into, pieces, unpack
from schemas.tensors import TensorRef

log = structlog.get_logger(__name__)

NAME: Final = "nats"
# Fewer, larger chunks mean fewer publish acks; capped by the server's max_payload.
_CHUNK = 1 << 20
# Bytes asked for per fetch: well under nats-py's 64 MiB pending limit per subscription.
_FETCH_BYTES = 16 << 20


def tensor_bucket(namespace: str) -> str:
    return f"MMPIPE_{namespace}_TENSORS"


@dataclass
class _Obj:
    nbytes: int
    owner: str
    expires: float


class NatsTransport:
    """Tensors through the JetStream object store; host memory only."""

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
        # The object store holds host bytes; the device only matters to get().
        self.device = torch.device(device)
        safe_role = "".join(c if c.isalnum() or c in "-_" else "_" for c in role)
        self.holder = f"{safe_role}-{uuid.uuid4().hex[:12]}"
        self.last_transfer: tuple[int, float] = (0, 0.0)
        self._store: ObjectStore | None = None
        self._held: dict[str, _Obj] = {}
        self._held_bytes = 0
        self._freed = asyncio.Event()
        self._gauge = metrics.HELD_BYTES.labels(NAME)
        self._tasks: list[asyncio.Task[None]] = []
        self._watcher: ObjectStore.ObjectWatcher | None = None
        self._closing = False

    async def _bucket(self, bucket: str) -> ObjectStore:
        js = self._js
        try:
            return await js.object_store(bucket)
        except nats.js.errors.BucketNotFoundError:
            try:
                return await js.create_object_store(bucket, ttl=self.settings.ttl_s, replicas=self.settings.replicas)
            except nats.js.errors.BadRequestError:
                return await js.object_store(bucket)  # another worker created it first

    async def start(self) -> None:
        bucket = tensor_bucket(self._ns)
        # On a cluster just started (or electing) the bucket may not answer yet: retried.
        self._store = await retrying(f"object store {bucket}", lambda: self._bucket(bucket), timeout_s=60.0)
        store = self._store
        self._watcher = await retrying(f"watch of {bucket}", lambda: store.watch(updates_only=True), timeout_s=60.0)
        self._tasks = [
            asyncio.create_task(self._watch(self._watcher), name=f"nats-tensors-watch-{self.holder}"),
            asyncio.create_task(self._expire(), name=f"nats-tensors-expire-{self.holder}"),
        ]
        log.info("tensor_transport_started", transport=NAME, holder=self.holder, budget=self.settings.budget_bytes)

    async def close(self) -> None:
        # A flag as well as cancel(): nats-py swallows CancelledError in places
        # (e.g. flush), which would leave a cancelled loop running.
        self._closing = True
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)
        self._tasks = []
        if self._watcher is not None:
            watcher, self._watcher = self._watcher, None
            try:
                await watcher.stop()
            except Exception as exc:
                log.debug("nats_tensors_watch_stop_failed", error=repr(exc))
        # What is still held stays readable until the bucket's TTL: it lives in the server.
        self._gauge.dec(self._held_bytes)
        self._held.clear()
        self._held_bytes = 0

    # -- holder side -----------------------------------------------------

    @property
    def held_bytes(self) -> int:
        return self._held_bytes

    def has_room(self, nbytes: int = 0) -> bool:
        return self._held_bytes + max(nbytes, 1) <= self.settings.budget_bytes

    async def put(self, tensors: list[torch.Tensor], *, owner: str) -> TensorRef:
        assert self._store is not None, "start() first"
        t0 = time.monotonic()
        specs, nbytes = layout(tensors)
        await self._reserve(nbytes)
        key = uuid.uuid4().hex
        self._count(key, _Obj(nbytes, owner, time.time() + self.settings.ttl_s))
        try:
            buf = torch.empty(nbytes, dtype=torch.uint8)
            await copy_bytes(lambda: pack_into(buf, tensors, specs), nbytes, buf.device, *{t.device for t in tensors})
            data = await asyncio.to_thread(buf.numpy().tobytes) if nbytes >= (1 << 20) else buf.numpy().tobytes()
            chunk = max(1024, min(_CHUNK, self._nc.max_payload - 4096))
            meta = api.ObjectMeta(name=key, options=api.ObjectMetaOptions(max_chunk_size=chunk))
            await self._store.put(key, data, meta=meta)
        except (nats.errors.Error, TimeoutError) as exc:
            self._uncount(key)
            metrics.ERRORS.labels(NAME, "put_failed").inc()
            log.warning("nats_tensor_put_failed", key=key, owner=owner, nbytes=nbytes, error=repr(exc))
            raise TransportFull(f"the NATS object store did not take {nbytes} bytes: {exc!r}") from exc
        except BaseException:
            self._uncount(key)
            raise
        dt = time.monotonic() - t0
        self.last_transfer = (nbytes, dt)
        metrics.BYTES.labels(NAME, "put").inc(nbytes)
        return TensorRef(
            transport=NAME,
            holder=self.holder,
            key=key,
            addr=0,
            nbytes=nbytes,
            mem="DRAM",
            device_id=0,
            tensors=specs,
            expires=self._held[key].expires,
        )

    async def _reserve(self, nbytes: int) -> None:
        budget = self.settings.budget_bytes
        if nbytes > budget:
            metrics.ERRORS.labels(NAME, "too_large").inc()
            raise TransportFull(f"{nbytes} bytes of tensors exceed the whole tensor budget of {budget} bytes")
        deadline = time.monotonic() + self.settings.put_wait_s
        reconciled = False
        while self._held_bytes + nbytes > budget:
            if not reconciled:
                reconciled = True
                await self._reconcile()
                continue
            self._freed.clear()
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    await self._freed.wait()
            except TimeoutError:
                metrics.ERRORS.labels(NAME, "full").inc()
                raise TransportFull(
                    f"tensor budget full: {self._held_bytes} of {budget} bytes held, "
                    f"{nbytes} more needed, waited {self.settings.put_wait_s:.1f}s"
                ) from None

    async def _reconcile(self) -> None:
        """Stop counting objects that are gone even though the watch did not say so."""
        assert self._store is not None
        for key in list(self._held):
            try:
                await self._store.get_info(key)
            except nats.js.errors.NotFoundError:
                self._uncount(key)
            except Exception as exc:
                log.debug("nats_tensor_reconcile_failed", key=key, error=repr(exc))

    def _count(self, key: str, obj: _Obj) -> None:
        self._held[key] = obj
        self._held_bytes += obj.nbytes
        self._gauge.inc(obj.nbytes)

    def _uncount(self, key: str) -> _Obj | None:
        obj = self._held.pop(key, None)
        if obj is not None:
            self._held_bytes -= obj.nbytes
            self._gauge.dec(obj.nbytes)
            self._freed.set()
        return obj

    async def release(self, ref: TensorRef) -> None:
        if ref.holder == self.holder and self._uncount(ref.key) is not None:
            await self._delete(ref.key)

    async def release_owner(self, owner: str) -> int:
        mine = [key for key, obj in self._held.items() if obj.owner == owner]
        for key in mine:
            if self._uncount(key) is not None:
                await self._delete(key)
        return len(mine)

    async def _delete(self, key: str) -> None:
        assert self._store is not None
        try:
            await self._store.delete(key)
        except nats.js.errors.NotFoundError:
            pass  # another reader, or the TTL, got there first
        except Exception as exc:
            metrics.ERRORS.labels(NAME, "delete_failed").inc()
            log.warning("nats_tensor_delete_failed", key=key, error=repr(exc))

    async def _watch(self, watcher: ObjectStore.ObjectWatcher) -> None:
        while not self._closing:
            try:
                info = await watcher.updates(timeout=3600)
            except nats.errors.TimeoutError:
                continue
            if info is not None and info.deleted and info.name:
                self._uncount(info.name)

    async def _expire(self) -> None:
        period = min(1.0, max(0.05, self.settings.ttl_s / 4))
        while not self._closing:
            await asyncio.sleep(period)
            now = time.time()
            for key, obj in list(self._held.items()):
                if now > obj.expires:
                    metrics.EXPIRED.labels(NAME).inc()
                    log.warning("tensor_expired_unread", transport=NAME, key=key, owner=obj.owner)
                    self._uncount(key)
                    # The bucket's TTL may be longer than ours (another worker made the bucket).
                    await self._delete(key)

    # -- reader side -----------------------------------------------------

    async def get_into(self, ref: TensorRef, targets: list[Target]) -> None:
        """The bytes come through this process anyway: get, then copy."""
        check_targets(targets, ref.tensors)
        got = await self.get(ref, pieces(targets[0])[0].device if targets else "cpu")
        for target, tensor in zip(targets, got, strict=True):
            copy_into(target, tensor)

    async def get(self, ref: TensorRef, device: torch.device | str = "cpu") -> list[torch.Tensor]:
        assert self._store is not None, "start() first"
        t0 = time.monotonic()
        if ref.transport != NAME:
            raise ValueError(f"a {ref.transport!r} tensor ref was given to the {NAME!r} transport")
        check_specs(ref.tensors, ref.nbytes)
        if time.time() > ref.expires:
            metrics.ERRORS.labels(NAME, "expired_ref").inc()
            raise TensorGone(f"tensors {ref.key} of {ref.holder} expired before they were read")
        out = torch.empty(ref.nbytes, dtype=torch.uint8)
        try:
            async with asyncio.timeout(self.settings.get_timeout_s):
                await self._read_object(ref, out)
        except nats.js.errors.NotFoundError:
            metrics.ERRORS.labels(NAME, "gone").inc()
            raise TensorGone(f"tensors {ref.key} of {ref.holder} are gone (read, released or expired)") from None
        except TimeoutError:
            metrics.ERRORS.labels(NAME, "get_timeout").inc()
            raise TensorGone(f"tensors {ref.key} did not arrive within {self.settings.get_timeout_s}s") from None
        except nats.errors.Error as exc:
            metrics.ERRORS.labels(NAME, "get_failed").inc()
            log.warning("nats_tensor_get_failed", key=ref.key, holder=ref.holder, error=repr(exc))
            raise TensorGone(f"tensors {ref.key} could not be read: {exc!r}") from exc
        await self._delete(ref.key)
        target = torch.device(device)
        if target.type != "cpu":
            moved = torch.empty(ref.nbytes, dtype=torch.uint8, device=target)
            await copy_bytes(lambda: moved.copy_(out), ref.nbytes, target)
            out = moved
        dt = time.monotonic() - t0
        self.last_transfer = (ref.nbytes, dt)
        metrics.BYTES.labels(NAME, "get").inc(ref.nbytes)
        metrics.TRANSFER_SECONDS.labels(NAME).observe(dt)
        return unpack(out, ref.tensors)

    async def _read_object(self, ref: TensorRef, out: torch.Tensor) -> None:
        """The object's chunks, straight into ``out``.

        Not ``ObjectStore.get``: its push consumer waits for nats-py to answer
        flow control, which it does every 250 ms, so 64 MB took ~1.5 s; this
        pull consumer takes ~0.15 s. No digest check: JetStream checksums what
        it stores, and the chunk count and total size are checked here.
        """
        assert self._store is not None
        info = await self._store.get_info(ref.key)
        if info.size != ref.nbytes:
            raise TensorGone(f"tensors {ref.key}: the object has {info.size} bytes, the ref says {ref.nbytes}")
        chunks = info.chunks or 0
        if not chunks:
            return
        view = memoryview(out.numpy().data)
        stream, subject = f"OBJ_{tensor_bucket(self._ns)}", f"$O.{tensor_bucket(self._ns)}.C.{info.nuid}"
        pos = 0
        if chunks == 1:
            last = await self._js.get_last_msg(stream, subject, direct=True)  # no base64 JSON round trip
            only = last.data or b""
            if len(only) > len(view):
                raise TensorGone(f"tensors {ref.key}: the object is larger than its {ref.nbytes} bytes")
            view[: len(only)] = only
            pos = len(only)
        else:
            config = api.ConsumerConfig(
                ack_policy=api.AckPolicy.NONE, mem_storage=True, inactive_threshold=self.settings.get_timeout_s
            )
            sub = await self._js.pull_subscribe(subject, stream=stream, config=config)
            chunk_size = (info.options.max_chunk_size if info.options else None) or _CHUNK
            batch = max(1, _FETCH_BYTES // chunk_size)
            try:
                got = 0
                while got < chunks:
                    for msg in await sub.fetch(min(batch, chunks - got), timeout=self.settings.get_timeout_s):
                        data = msg.data or b""
                        n = len(data)
                        if pos + n > len(view):
                            raise TensorGone(f"tensors {ref.key}: the object is larger than its {ref.nbytes} bytes")
                        view[pos : pos + n] = data
                        pos += n
                        got += 1
            finally:
                await sub.unsubscribe()
        if pos != ref.nbytes:
            raise TensorGone(f"tensors {ref.key}: got {pos} bytes, the ref says {ref.nbytes}")
