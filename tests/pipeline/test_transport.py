"""Contract tests of the tensor transports against a real nats-server and
real NIXL (UCX on host memory), in one process and across two."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import structlog
import torch

from pipeline.connection import connect
from pipeline.nats_server import NatsServer
from pipeline.transport import (
    TensorGone,
    TensorTransport,
    TransportFull,
    TransportSettings,
    TransportUnavailable,
    open_transport,
)
from pipeline.transport.arena import FirstFit
from pipeline.transport.holder import HeldRegions
from pipeline.transport.nats_store import NatsTransport
from pipeline.transport.nixl import NixlTransport
from pipeline.transport.packing import Target, target_runs
from schemas.tensors import TensorRef
from tests.pipeline.transport_peer import ANSWER, digests, make_tensors
from tests.polling import eventually

KINDS = ["nixl", "nats"]
REPO = Path(__file__).resolve().parents[2]
NIXL_MODULES = ("nixl", "nixl._api", "nixl_cu13", "nixl_cu13._api", "nixl_cu12", "nixl_cu12._api")
MiB = 1 << 20

Factory = Callable[..., Awaitable[TensorTransport]]


@pytest.fixture
async def make_transport(nats_server: NatsServer, namespace: str) -> AsyncIterator[Factory]:
    """Started transports on their own connections, as separate workers would have."""
    opened: list[tuple[TensorTransport, Any]] = []

    async def make(kind: str, role: str = "worker", device: str = "cpu", **settings: Any) -> TensorTransport:
        nc, js = await connect(nats_server.url, name=f"test-{role}")
        settings.setdefault("budget_bytes", 4 * MiB)
        try:
            transport = await open_transport(kind, nc, js, namespace, TransportSettings(**settings), role, device)
        except BaseException:
            await nc.close()
            raise
        opened.append((transport, nc))
        return transport

    yield make
    for transport, nc in opened:
        await transport.close()
        await nc.close()


class Peer:
    """A transport in a child process (tests/pipeline/transport_peer.py)."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        await self.proc.stdin.drain()

    async def answer(self) -> list[str]:
        assert self.proc.stdout is not None
        async with asyncio.timeout(30):  # a child that starts torch and NIXL: seconds
            while True:
                line = (await self.proc.stdout.readline()).decode()
                if not line:
                    raise AssertionError(f"peer exited with {await self.proc.wait()}")
                if line.startswith(ANSWER):
                    return line.rstrip("\n").split(maxsplit=2)[1:]

    async def put(self, seed: int) -> TensorRef:
        await self.send(op="put", seed=seed)
        kind, body = await self.answer()
        assert kind == "ref", body
        return msgspec.json.decode(body, type=TensorRef)

    async def get(self, ref: TensorRef) -> list[str]:
        await self.send(op="get", ref=msgspec.to_builtins(ref))
        return await self.answer()

    async def held(self) -> int:
        await self.send(op="held")
        _, body = await self.answer()
        return int(body)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)


@pytest.fixture
async def spawn_peer(nats_server: NatsServer, namespace: str) -> AsyncIterator[Callable[[str], Awaitable[Peer]]]:
    peers: list[Peer] = []

    async def spawn(kind: str) -> Peer:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.pipeline.transport_peer",
            "--url",
            nats_server.url,
            "--namespace",
            namespace,
            "--transport",
            kind,
            cwd=REPO,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "NIXL_LOG_LEVEL": "WARN"},
        )
        peer = Peer(proc)
        peers.append(peer)
        assert await peer.answer() == ["ready", kind]
        return peer

    yield spawn
    for peer in peers:
        if peer.proc.returncode is None:
            await peer.send(op="exit")
            try:
                async with asyncio.timeout(10):
                    await peer.proc.wait()
            except TimeoutError:
                peer.kill()
                await peer.proc.wait()
        assert peer.proc.stdin is not None
        peer.proc.stdin.close()


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g, w)
    assert digests(got) == digests(want)  # bit-exact, NaN payloads and signed zeros included


# -- across two OS processes -------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
async def test_round_trip_between_processes(kind: str, make_transport: Factory, spawn_peer: Any) -> None:
    peer = await spawn_peer(kind)
    here = await make_transport(kind, "reader")

    # The child holds, this process reads, and the child frees once read.
    ref = await peer.put(seed=1)
    assert ref.transport == kind
    assert_same(await here.get(ref), make_tensors(1))
    for _ in range(200):
        if await peer.held() == 0:
            break
        await asyncio.sleep(0.01)
    assert await peer.held() == 0

    # This process holds, the child reads.
    ref = await here.put(make_tensors(2), owner="r2")
    kind_, body = await peer.get(ref)
    assert kind_ == "got", body
    assert json.loads(body) == digests(make_tensors(2))
    await eventually(lambda: here.held_bytes == 0)


@pytest.mark.parametrize("kind", KINDS)
async def test_holder_killed(kind: str, make_transport: Factory, spawn_peer: Any) -> None:
    peer = await spawn_peer(kind)
    reader = await make_transport(kind, "reader", get_timeout_s=3, lease_s=4)
    ref = await peer.put(seed=3)
    peer.kill()
    await peer.proc.wait()
    started = time.monotonic()
    if kind == "nixl":
        # The bytes lived in the holder's memory: gone with it, and said so fast.
        with pytest.raises(TensorGone):
            await reader.get(ref)
    else:
        # The object store keeps the bytes in the server: the holder's death does not matter.
        assert_same(await reader.get(ref), make_tensors(3))
    assert time.monotonic() - started < 3 + 1


async def test_nixl_holder_killed_between_lease_and_read(
    make_transport: Factory, spawn_peer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A holder met for the first time: the lease comes back before UCX connects.
    peer = await spawn_peer("nixl")
    reader = await make_transport("nixl", "reader", get_timeout_s=3, lease_s=4)
    assert isinstance(reader, NixlTransport)
    ref = await peer.put(seed=5)
    claim = reader._reads.claim

    async def claim_then_kill(ref: TensorRef, deadline: float, lease: int) -> tuple[int, float]:
        granted = await claim(ref, deadline, lease)
        peer.kill()
        await peer.proc.wait()
        return granted

    monkeypatch.setattr(reader._reads, "claim", claim_then_kill)
    started = time.monotonic()
    with pytest.raises(TensorGone):
        await reader.get(ref)
    assert time.monotonic() - started < 3 + 1
    assert reader._recv_alloc.used_bytes == 0 or reader._quarantined


async def test_nixl_holder_killed_with_the_connection_up(make_transport: Factory, spawn_peer: Any) -> None:
    # A known holder: the READ goes out beside the lease request, to a dead process.
    peer = await spawn_peer("nixl")
    reader = await make_transport("nixl", "reader", get_timeout_s=3, lease_s=4)
    assert isinstance(reader, NixlTransport)
    assert_same(await reader.get(await peer.put(seed=4)), make_tensors(4))
    ref = await peer.put(seed=5)
    peer.kill()
    await peer.proc.wait()
    started = time.monotonic()
    with pytest.raises(TensorGone):
        await reader.get(ref)
    assert time.monotonic() - started < 3 + 1
    assert reader._recv_alloc.used_bytes == 0 or reader._quarantined
    # The holder's metadata is loaded afresh next time: it may have re-registered.
    assert reader._reads._remotes[ref.holder].stale


async def test_nixl_an_unanswered_lease_request_is_asked_again(make_transport: Factory, spawn_peer: Any) -> None:
    """A holder that does not answer for a while (paused here; in a NATS
    failover a node goes with the request or its answer) is asked again
    while the get may wait, not taken for gone: a TensorGone restarts the
    request, an attempt spent on tensors still held. The holder grants the
    lease it may have granted to the lost request again."""
    peer = await spawn_peer("nixl")
    reader = await make_transport("nixl", "reader", get_timeout_s=8, lease_s=10, request_timeout_s=1.0)
    ref = await peer.put(seed=6)
    peer.proc.send_signal(signal.SIGSTOP)
    try:
        got = asyncio.create_task(reader.get(ref))
        await asyncio.sleep(1.5)  # past the first request's timeout
        assert not got.done()
    finally:
        peer.proc.send_signal(signal.SIGCONT)
    assert_same(await got, make_tensors(6))


async def test_nixl_holder_metadata_late_is_asked_for_again(
    make_transport: Factory, spawn_peer: Any, nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agents' bucket not answering for a while (its stream electing a
    leader after a NATS node was lost; the server paused here) says nothing
    of the holder: its metadata is asked for again while the get may wait."""
    peer = await spawn_peer("nixl")
    reader = await make_transport("nixl", "reader", get_timeout_s=8, lease_s=10, request_timeout_s=1.0)
    assert isinstance(reader, NixlTransport)
    ref = await peer.put(seed=7)
    claim = reader._reads.claim
    assert nats_server.pid is not None
    server = nats_server.pid

    async def claim_then_pause_nats(ref: TensorRef, deadline: float, lease: int) -> tuple[int, float]:
        granted = await claim(ref, deadline, lease)
        os.kill(server, signal.SIGSTOP)
        asyncio.get_running_loop().call_later(1.5, os.kill, server, signal.SIGCONT)
        return granted

    monkeypatch.setattr(reader._reads, "claim", claim_then_pause_nats)
    try:
        assert_same(await reader.get(ref), make_tensors(7))
    finally:
        os.kill(server, signal.SIGCONT)


# -- one process -------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
async def test_freed_after_get_and_read_once(kind: str, make_transport: Factory) -> None:
    holder = await make_transport(kind, "holder")
    reader = await make_transport(kind, "reader")
    tensors = make_tensors(6)
    ref = await holder.put(tensors, owner="r6")
    assert holder.held_bytes >= ref.nbytes > 0
    assert_same(await reader.get(ref), tensors)
    assert reader.last_transfer[0] == ref.nbytes and reader.last_transfer[1] > 0
    await eventually(lambda: holder.held_bytes == 0)
    with pytest.raises(TensorGone):
        await reader.get(ref)


async def test_nixl_stale_ref_never_reads_reused_memory(make_transport: Factory) -> None:
    holder = await make_transport("nixl", "holder")
    reader = await make_transport("nixl", "reader")
    first = await holder.put([torch.full((1000,), 1.0)], owner="first")
    await reader.get(first)
    await eventually(lambda: holder.held_bytes == 0)
    second = await holder.put([torch.full((1000,), 2.0)], owner="second")
    assert second.addr == first.addr  # the region was reused
    with pytest.raises(TensorGone):
        await reader.get(first)
    assert torch.equal((await reader.get(second))[0], torch.full((1000,), 2.0))


@pytest.mark.parametrize("kind", KINDS)
async def test_concurrent_gets(kind: str, make_transport: Factory) -> None:
    holder = await make_transport(kind, "holder")
    reader = await make_transport(kind, "reader")
    refs = [await holder.put(make_tensors(seed), owner=f"r{seed}") for seed in range(20, 26)]
    got = await asyncio.gather(*(reader.get(ref) for ref in refs))
    for seed, tensors in zip(range(20, 26), got, strict=True):
        assert_same(tensors, make_tensors(seed))
    await eventually(lambda: holder.held_bytes == 0)


async def test_nixl_two_readers_of_one_ref_one_wins(make_transport: Factory) -> None:
    # A redelivered message may reach a second worker while the first still reads.
    holder = await make_transport("nixl", "holder")
    readers = [await make_transport("nixl", f"reader{i}") for i in range(2)]
    ref = await holder.put(make_tensors(10), owner="r10")
    results = await asyncio.gather(*(r.get(ref) for r in readers), return_exceptions=True)
    assert sorted(type(r).__name__ for r in results) == ["TensorGone", "list"]
    assert_same(next(r for r in results if isinstance(r, list)), make_tensors(10))


async def test_nixl_read_of_a_known_holder_goes_out_before_its_lease(
    make_transport: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    holder = await make_transport("nixl", "holder")
    reader = await make_transport("nixl", "reader")
    assert isinstance(holder, NixlTransport) and isinstance(reader, NixlTransport)
    assert_same(await reader.get(await holder.put(make_tensors(11), owner="r11")), make_tensors(11))
    ref = await holder.put(make_tensors(12), owner="r12")
    claim = reader._reads.claim
    notified_first: list[bool] = []

    async def slow_request(ref: TensorRef, deadline: float, lease: int) -> tuple[int, float]:
        # The lease request held back (a slow network): the READ must not wait for it.
        held = holder._held.get(ref.key)
        assert held is not None
        await eventually(lambda: lease in held.early, within=5.0)
        notified_first.append(True)
        return await claim(ref, deadline, lease)

    monkeypatch.setattr(reader._reads, "claim", slow_request)
    assert_same(await reader.get(ref), make_tensors(12))
    assert notified_first == [True]
    assert holder.held_bytes == 0  # freed when the lease was granted: its READ was already done


class Gate:
    """Stands in for the CUDA event of a copy still queued on the holder's
    GPU (the CPU has none): ``query()`` and a blocking ``synchronize()``, as
    a torch.cuda.Event has; ``open`` lands the copy."""

    def __init__(self) -> None:
        self._landed = threading.Event()

    @property
    def open(self) -> bool:
        return self._landed.is_set()

    @open.setter
    def open(self, value: bool) -> None:
        assert value, "a copy that landed stays landed"
        self._landed.set()

    def query(self) -> bool:
        return self.open

    def synchronize(self) -> None:
        self._landed.wait()


@pytest.fixture
def gates() -> Iterator[list[Gate]]:
    """Every gate a test shuts is opened when it ends, passed or failed: a
    holder's thread waits on it, and the interpreter cannot exit until that
    thread ends."""
    made: list[Gate] = []
    yield made
    for gate in made:
        gate.open = True


async def _not_landed(holder: NixlTransport, seed: int, gates: list[Gate]) -> tuple[TensorRef, Gate]:
    ref = await holder.put(make_tensors(seed), owner=f"r{seed}")
    held = holder._held.get(ref.key)
    assert held is not None and ref.landed
    gate = Gate()
    gates.append(gate)
    held.landing = gate
    return msgspec.structs.replace(ref, landed=False), gate


@pytest.mark.parametrize("known_holder", [False, True])
async def test_nixl_a_lease_waits_for_the_copy_to_land_and_the_read_for_the_lease(
    make_transport: Factory, known_holder: bool, gates: list[Gate]
) -> None:
    holder = await make_transport("nixl", "holder")
    reader = await make_transport("nixl", "reader")
    assert isinstance(holder, NixlTransport) and isinstance(reader, NixlTransport)
    if known_holder:  # a holder read before would get the READ beside the lease request
        assert_same(await reader.get(await holder.put(make_tensors(20), owner="r20")), make_tensors(20))
    ref, gate = await _not_landed(holder, 21, gates)
    held = holder._held.get(ref.key)
    assert held is not None
    got = asyncio.create_task(reader.get(ref))
    await eventually(lambda: bool(holder._landing_waits), within=5.0)
    await asyncio.sleep(0.1)  # a READ posted now would have notified by the time it matters
    assert not got.done() and not held.early and not held.lease and not held.done
    gate.open = True
    assert_same(await asyncio.wait_for(got, 10), make_tensors(21))
    await eventually(lambda: holder.held_bytes == 0)


async def test_nixl_a_copy_that_lands_late_is_asked_for_again(
    make_transport: Factory, monkeypatch: pytest.MonkeyPatch, gates: list[Gate]
) -> None:
    # The holder answers "landing" after half the request timeout; the reader asks again until its get times out.
    holder = await make_transport("nixl", "holder", request_timeout_s=0.2)
    reader = await make_transport("nixl", "reader", request_timeout_s=0.2)
    assert isinstance(holder, NixlTransport) and isinstance(reader, NixlTransport)
    ref, gate = await _not_landed(holder, 22, gates)
    ask = reader._reads._ask
    reasons: list[str] = []

    async def recorded(*args: Any) -> Any:
        reply = await ask(*args)
        # None: the answer came too late (a loaded machine), and the reader asks again.
        reasons.append(reply.reason if reply is not None else "unanswered")
        return reply

    monkeypatch.setattr(reader._reads, "_ask", recorded)
    got = asyncio.create_task(reader.get(ref))
    await eventually(lambda: reasons.count("landing") >= 2, within=10.0)
    assert not got.done()
    gate.open = True
    assert_same(await asyncio.wait_for(got, 10), make_tensors(22))
    assert reasons[-1] == ""


async def test_nixl_a_copy_that_never_lands_ends_the_get(make_transport: Factory, gates: list[Gate]) -> None:
    # Asks long enough that the holder's "landing" (at 3/4 of each) comes back on a loaded machine.
    holder = await make_transport("nixl", "holder", request_timeout_s=1.0)
    reader = await make_transport("nixl", "reader", request_timeout_s=1.0, get_timeout_s=3.0, lease_s=5.0)
    assert isinstance(holder, NixlTransport) and isinstance(reader, NixlTransport)
    ref, _ = await _not_landed(holder, 23, gates)
    with pytest.raises(TensorGone, match="landing"):
        await reader.get(ref)
    assert holder.held_bytes > 0  # still held for a later reader: only this get gave up


async def test_nixl_put_on_a_busy_gpu_goes_out_before_its_bytes_land(
    make_transport: Factory, engine_device: str
) -> None:
    """On a GPU (--engine-device cuda): the ref of tensors a kernel is still
    making leaves at once, and a reader in another agent gets their bytes."""
    if not engine_device.startswith("cuda"):
        pytest.skip("a copy queued behind GPU work needs CUDA (--engine-device cuda)")
    holder = await make_transport("nixl", "holder", device=engine_device)
    reader = await make_transport("nixl", "reader", device=engine_device)
    want = [t.to(engine_device) for t in make_tensors(24)]
    # Each kernel's first launch loads its module, which waits for the whole GPU: launch them all once first.
    await holder.release(await holder.put([t * 1 for t in want], owner="warm-up"))
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s of a spinning kernel ahead of the tensors on the stream
    made = [t * 1 for t in want]
    ref = await holder.put(made, owner="r24")
    assert not ref.landed
    got = await reader.get(ref, engine_device)
    assert_same([t.cpu() for t in got], make_tensors(24))


async def test_nixl_reads_its_own_tensors_without_a_transfer(make_transport: Factory) -> None:
    both = await make_transport("nixl", "encode_prefill")
    ref = await both.put(make_tensors(7), owner="r7")
    assert_same(await both.get(ref), make_tensors(7))
    assert both.held_bytes == 0
    with pytest.raises(TensorGone):
        await both.get(ref)


@pytest.mark.parametrize("kind", KINDS)
async def test_release_frees_at_once(kind: str, make_transport: Factory) -> None:
    holder = await make_transport(kind, "holder")
    reader = await make_transport(kind, "reader")
    ref = await holder.put(make_tensors(8), owner="cancelled")
    await holder.release(ref)
    assert holder.held_bytes == 0
    with pytest.raises(TensorGone):
        await reader.get(ref)


@pytest.mark.parametrize("kind", KINDS)
async def test_ttl_frees_unread(kind: str, make_transport: Factory) -> None:
    holder = await make_transport(kind, "holder", ttl_s=0.3)
    reader = await make_transport(kind, "reader")
    ref = await holder.put(make_tensors(9), owner="nobody-reads")
    await eventually(lambda: holder.held_bytes == 0, within=3)
    with pytest.raises(TensorGone):
        await reader.get(ref)


@pytest.mark.parametrize("kind", KINDS)
async def test_budget(kind: str, make_transport: Factory) -> None:
    holder = await make_transport(kind, "holder", budget_bytes=1 * MiB, put_wait_s=0.3)
    reader = await make_transport(kind, "reader", budget_bytes=1 * MiB)
    big = [torch.ones(600 * 1024, dtype=torch.uint8)]
    assert holder.has_room(len(big[0]))

    with pytest.raises(TransportFull, match="exceed the whole tensor budget"):
        await holder.put([torch.ones(2 * MiB, dtype=torch.uint8)], owner="huge")

    first = await holder.put(big, owner="first")
    assert not holder.has_room(len(big[0]))
    with pytest.raises(TransportFull, match="budget full"):
        await holder.put(big, owner="no-room")  # nobody reads: gives up after put_wait_s

    async def read_later() -> list[torch.Tensor]:
        await asyncio.sleep(0.1)
        return await reader.get(first)

    put = asyncio.create_task(holder.put([torch.full((600 * 1024,), 7, dtype=torch.uint8)], owner="second"))
    got = await read_later()
    second = await put  # waited for the read to free the first region
    assert torch.equal(got[0], big[0])
    assert torch.equal((await reader.get(second))[0], torch.full((600 * 1024,), 7, dtype=torch.uint8))
    await eventually(lambda: holder.held_bytes == 0)
    assert holder.has_room(len(big[0]))


async def test_nats_store_ignores_max_payload(make_transport: Factory) -> None:
    # The embedded server allows 8 MiB per message; the object store chunks.
    holder = await make_transport("nats", "holder", budget_bytes=32 * MiB)
    reader = await make_transport("nats", "reader", budget_bytes=32 * MiB)
    tensor = torch.randn(5 * MiB // 4 * 4)  # 20 MiB
    ref = await holder.put([tensor], owner="large")
    assert torch.equal((await reader.get(ref))[0], tensor)


# -- choosing ----------------------------------------------------------------------


async def test_select(make_transport: Factory, monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(await make_transport("auto"), NixlTransport)
    assert isinstance(await make_transport("nixl"), NixlTransport)
    assert isinstance(await make_transport("nats"), NatsTransport)
    with pytest.raises(ValueError, match="unknown tensor transport"):
        await make_transport("carrier-pigeon")

    for name in NIXL_MODULES:  # as on a host without NIXL
        monkeypatch.setitem(sys.modules, name, None)
    with structlog.testing.capture_logs() as logs:
        assert isinstance(await make_transport("auto"), NatsTransport)
    assert any(e["event"] == "tensor_transport_fallback" and e["log_level"] == "warning" for e in logs)
    with pytest.raises(TransportUnavailable, match="pip install nixl-cu13"):
        await make_transport("nixl")


# -- pieces ------------------------------------------------------------------------


async def test_a_region_released_while_leased_waits_for_the_lease() -> None:
    regions = HeldRegions("test", 4096, ttl_s=60)
    held = await regions.reserve(1000, owner="r", wait_s=0)
    regions.publish(held)
    assert regions.lease(held.key, 1, lease_s=5) == ""
    assert regions.lease(held.key, 2, lease_s=5) == "claimed"
    regions.release(held.key)  # cancelled while a reader may be mid-READ
    assert regions.used_bytes > 0
    regions.end_lease(held.key, 1, read=False)  # the reader gave up
    assert regions.used_bytes == 0
    assert regions.lease(held.key, 3, lease_s=5) == "unknown"

    held = await regions.reserve(1000, owner="r", wait_s=0)
    regions.publish(held)
    assert regions.lease(held.key, 4, lease_s=0) == ""
    await asyncio.sleep(0.01)
    regions.sweep()  # the lease lapsed without a read: another reader may have it
    assert regions.lease(held.key, 5, lease_s=5) == ""
    regions.end_lease(held.key, 5, read=True)
    assert regions.used_bytes == 0


async def test_a_lease_asked_for_again_by_its_reader_is_granted_again() -> None:
    # Its answer was lost: the reader asks again under the same lease id, from later on.
    regions = HeldRegions("nixl", 4096, ttl_s=60)
    held = await regions.reserve(1000, owner="r", wait_s=0)
    regions.publish(held)
    assert regions.lease(held.key, 1, lease_s=0) == ""
    first_until = held.lease_until
    assert regions.lease(held.key, 1, lease_s=5) == ""
    assert held.lease == 1 and held.lease_until > first_until  # pinned from the new request on
    assert regions.lease(held.key, 2, lease_s=5) == "claimed"
    regions.end_lease(held.key, 1, read=True)
    assert regions.used_bytes == 0
    # Its READ (posted beside the request) freed the region before the answer
    # came: the bytes it got were the ref's, and that lease alone says so.
    assert regions.lease(held.key, 1, lease_s=5) == ""
    assert regions.lease(held.key, 2, lease_s=5) == "unknown"

    held = await regions.reserve(1000, owner="r", wait_s=0)
    regions.publish(held)
    regions.end_lease(held.key, 3, read=True)  # the READ's notification before any request
    assert regions.lease(held.key, 3, lease_s=5) == ""  # read: freed
    assert regions.used_bytes == 0
    assert regions.lease(held.key, 3, lease_s=5) == ""  # that answer lost too

    held = await regions.reserve(1000, owner="r", wait_s=0)
    regions.publish(held)
    regions.release(held.key)  # freed unread: a READ under any lease may have met reused memory
    regions.end_lease(held.key, 4, read=True)
    assert regions.lease(held.key, 4, lease_s=5) == "unknown"


async def test_a_read_notified_before_its_lease_counts_once_the_lease_is_granted() -> None:
    # A reader that knows the holder posts its READ beside the lease request: the READ's
    # notification may come first, and must not count (nor be lost) until that lease is granted.
    regions = HeldRegions("nixl", 1 << 20, ttl_s=60)
    held = await regions.reserve(100, owner="r", wait_s=0)
    regions.publish(held)
    assert regions.end_lease(held.key, 7, read=True)
    assert regions.get(held.key) is held and not held.done
    assert regions.lease(held.key, 8, lease_s=5) == ""  # lease 7 was never granted: another may read
    regions.end_lease(held.key, 8, read=False)
    assert regions.lease(held.key, 7, lease_s=5) == ""  # granted to a READ already done: read, freed
    assert regions.get(held.key) is None and regions.used_bytes == 0
    assert regions.lease(held.key, 9, lease_s=5) == "unknown"


def test_first_fit_reuses_and_coalesces() -> None:
    arena = FirstFit(4096)
    a, b, c = arena.alloc(100), arena.alloc(300), arena.alloc(256)
    assert (a, b, c) == (0, 256, 768)
    assert arena.alloc(4096) is None
    arena.free(256)
    assert arena.alloc(512) == 256  # the hole fits exactly
    arena.free(0)
    arena.free(256)
    arena.free(768)
    assert arena.used_bytes == 0
    assert arena.alloc(4096) == 0  # all holes merged back into one


# -- straight into the reader's own tensors ----------------------------------------


# The blocks a KV hand-off lands in, scattered in the pool as a decoder's
# allocator may give them: two consecutive (one run of bytes), one apart.
BLOCKS = [5, 6, 2]


def _kv_block_targets(want: list[torch.Tensor]) -> tuple[list[Target], torch.Tensor, torch.Tensor]:
    """Targets for make_tensors: fresh tensors (one strided) for the mixed
    ones, and for the KV hand-off each tensor's blocks in a paged pool
    [layers, blocks, kv_heads, block_size, head_dim], as a decoder holds it."""
    keys = torch.zeros(3, 8, 2, 16, 64, dtype=torch.bfloat16)
    values = torch.zeros_like(keys)
    targets: list[Target] = [torch.empty(t.shape, dtype=t.dtype) for t in want[:7]]
    targets[4] = torch.empty(2, 3, dtype=torch.float16).t()
    for i in range(3):
        targets += [[keys[i, b] for b in BLOCKS], [values[i, b] for b in BLOCKS]]
    return targets, keys, values


def _same(targets: list[Target], want: list[torch.Tensor]) -> None:
    assert_same([t if isinstance(t, torch.Tensor) else torch.stack(t) for t in targets], want)


def _only_blocks_written(cache: torch.Tensor) -> bool:
    rest = cache.clone()
    rest[:, BLOCKS] = 0
    return not rest.any() and bool(cache[:, BLOCKS].any())


def test_a_tensors_pieces_are_read_as_few_runs() -> None:
    keys = torch.zeros(8, 2, 16, 64, dtype=torch.bfloat16)
    runs = target_runs([keys[b] for b in BLOCKS])
    block = keys[0].numel() * keys.element_size()
    assert [(n, offset) for _, n, offset in runs] == [(2 * block, 0), (block, 2 * block)]
    assert runs[0][0] == keys[5].data_ptr() and runs[1][0] == keys[2].data_ptr()


@pytest.mark.parametrize("kind", KINDS)
async def test_get_into_writes_a_peers_tensors_in_place(kind: str, make_transport: Factory, spawn_peer: Any) -> None:
    peer = await spawn_peer(kind)
    here = await make_transport(kind, "reader")
    want = make_tensors(3)
    targets, keys, values = _kv_block_targets(want)
    ref = await peer.put(seed=3)
    # Targets that do not match are refused before anything is read.
    with pytest.raises(ValueError, match="targets do not match"):
        await here.get_into(ref, targets[:-1])
    with pytest.raises(ValueError, match="targets do not match"):
        await here.get_into(ref, [*targets[:-1], [values[2, b] for b in BLOCKS[:2]]])  # a block short
    await here.get_into(ref, targets)
    _same(targets, want)
    assert _only_blocks_written(keys) and _only_blocks_written(values)
    assert here.last_transfer[0] == ref.nbytes
    for _ in range(200):
        if await peer.held() == 0:
            break
        await asyncio.sleep(0.01)
    assert await peer.held() == 0
    with pytest.raises(TensorGone):
        await here.get_into(ref, targets)  # read once


async def test_nixl_get_into_registers_a_cache_once_and_reads_its_own_tensors(make_transport: Factory) -> None:
    holder = await make_transport("nixl", "holder")
    reader = await make_transport("nixl", "reader")
    assert isinstance(reader, NixlTransport)
    want = make_tensors(5)
    targets, keys, _ = _kv_block_targets(want)
    for seed in (5, 6):
        await reader.get_into(await holder.put(make_tensors(seed), owner=f"r{seed}"), targets)
        _same(targets, make_tensors(seed))
    # The cache's two tensors and the six fresh ones not empty: each storage registered once.
    assert len(reader._targets) == 8 and keys.untyped_storage().data_ptr() in reader._targets
    # A worker reading what it put itself copies from its own arena.
    ref = await reader.put(make_tensors(7), owner="r7")
    await reader.get_into(ref, targets)
    _same(targets, make_tensors(7))
    assert reader.held_bytes == 0
