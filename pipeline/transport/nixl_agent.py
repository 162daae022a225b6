"""One NIXL agent, driven from asyncio.

The agent is not thread-safe (NIXL_THREAD_SYNC_NONE without a listener
thread), and UCX may finish a shared-memory READ inside ``transfer()``,
blocking its caller for the whole copy (512 MB took 0.27 s). So every agent
call runs on one dedicated thread, and the event loop only awaits it.

UCX's progress thread is off by default: NIXL 1.5.1 runs it without a delay,
so it spins a whole core even when idle. Without it, a transfer progresses
when its reader polls it and when its holder polls for notifications.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import ModuleType
from typing import Any, TypeVar

import structlog
import torch

from pipeline.transport.base import TransportUnavailable
from stages.compute_threads import one_thread

log = structlog.get_logger(__name__)
T = TypeVar("T")

_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")
Desc = tuple[int, int, int]  # (address, bytes, device id)
_SETTLE_POLLS = 10
_POLL_MAX_S = 0.0005


def load_nixl() -> ModuleType:
    """The NIXL python API: ``nixl._api`` comes with the ``nixl`` meta package,
    ``nixl_cu13._api`` / ``nixl_cu12._api`` with one CUDA flavour alone."""
    for name in _MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if not os.environ.get("NIXL_LOG_LEVEL"):
            # NIXL logs plain text to stdout at INFO, which would break a JSON-lines log stream.
            logging.getLogger("nixl").setLevel(logging.WARNING)
        return module
    raise TransportUnavailable(
        "NIXL is not installed: pip install nixl-cu13 (CUDA 13 or CPU) or nixl-cu12 (CUDA 12); "
        "or choose the 'nats' tensor transport"
    )


def _ucx_defaults(device: torch.device) -> None:
    """UCX settings for VRAM, unless the user set them. UCX turns CUDA IPC's
    GET off on a GPU without active NVLink (one GPU of a host, PCIe cards),
    and a READ of VRAM then falls back to TCP through host memory: 0.47 GB/s
    for 1 GB on an H100, against 1,470 GB/s for a device-to-device copy.
    mmpipe's transfers are READs, so GET over CUDA IPC is turned back on
    (as NIXL's later releases do)."""
    if device.type == "cuda":
        os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")


def _bind_thread(device: torch.device) -> None:
    """UCX moves VRAM with the CUDA driver API, which needs the device's
    context current on the calling thread: make it so on the NIXL thread
    (whose copies compute on one core: stages/compute_threads.py)."""
    one_thread()
    if device.type == "cuda":
        torch.cuda.set_device(device)


@dataclass
class ReadOutcome:
    # "DONE", "ERR", "PROC" (still running when we gave up) or "FAILED" (not started).
    state: str
    # A READ may have been started: its target memory may be written.
    posted: bool
    # The transfer handle is released, i.e. a running READ was cancelled.
    released: bool
    error: str = ""
    # When the READ was seen done (time.monotonic()), to hold against a lease.
    ended: float = 0.0
    # Seconds in each phase (a READ that ran): to the agent's thread, making the
    # transfer (descriptors, initialize_xfer), posting it, polling it there, then
    # in the event loop's polling and the release.
    phases: dict[str, float] = dataclasses.field(default_factory=dict)


class Agent:
    def __init__(self, name: str, device: torch.device, *, progress_thread: bool) -> None:
        self.name = name
        _ucx_defaults(device)
        self._api = load_nixl()
        self._progress_thread = progress_thread
        self._thread = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"nixl-{name}", initializer=_bind_thread, initargs=(device,)
        )
        self._agent: Any = None
        self._registered: list[Any] = []
        # Transfers whose release failed: released again (or dropped) on the agent's thread at close.
        self._unreleased: list[Any] = []
        # How long a posted READ is polled on the agent's thread before the event loop polls it.
        self._spin_s = 0.003 if device.type == "cuda" else 0.0005

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def start(self, memory: list[torch.Tensor]) -> bytes:
        """Create the agent, register ``memory`` (tensors of one device) and
        return the metadata peers need to READ it."""
        config = self._api.nixl_agent_config(enable_prog_thread=self._progress_thread, backends=["UCX"])
        try:
            self._agent = await self.call(self._api.nixl_agent, self.name, config)
        except RuntimeError as exc:  # e.g. "No plugins available for NIXL"
            raise TransportUnavailable(f"NIXL could not create an agent: {exc}") from exc
        if "UCX" not in self._agent.backends:
            raise TransportUnavailable("NIXL has no UCX backend plugin here; choose the 'nats' tensor transport")
        self._registered.append(await self.call(self._agent.register_memory, memory))
        # Peers cannot READ memory registered after they loaded this: export it after every registration.
        metadata: bytes = await self.call(self._agent.get_agent_metadata)
        return metadata

    async def register(self, memory: list[torch.Tensor]) -> None:
        """Register more local memory to READ into (peers need not know it)."""
        self._registered.append(await self.call(self._agent.register_memory, memory))

    async def notifications(self) -> dict[str, list[bytes]]:
        """New READ notifications by reader; also drives UCX progress."""
        notifs: dict[str, list[bytes]] = await self.call(self._agent.get_new_notifs)
        return notifs

    async def connect(self, metadata: bytes) -> str:
        """Load a peer's metadata (NIXL connects now); returns its agent name."""
        name = await self.call(self._agent.add_remote_agent, metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    async def forget(self, peer: str) -> None:
        try:
            await self.call(self._agent.remove_remote_agent, peer)
        except Exception as exc:
            log.debug("nixl_forget_failed", peer=peer, error=repr(exc))

    async def read(
        self,
        local: list[Desc],
        local_mem: str,
        remote: list[Desc],
        remote_mem: str,
        peer: str,
        notif: bytes,
        until: float,
    ) -> ReadOutcome:
        """READ ``remote`` of ``peer`` into ``local`` (descriptor lists of
        equal sizes, pairwise), polling until done or the monotonic time
        ``until``; ``notif`` goes to the peer when done."""
        agent = self._agent
        marks: dict[str, float] = {"start": time.perf_counter()}

        # Nothing raised on the agent's thread comes back as an exception: a traceback
        # would keep this frame (the handle, the agent) alive until a garbage collection
        # on whatever thread, where a NIXL destructor must not run.
        def post() -> tuple[Any, str, str]:
            marks["thread"] = time.perf_counter()
            try:
                local_descs = agent.get_xfer_descs(local, local_mem)
                remote_descs = agent.get_xfer_descs(remote, remote_mem)
                handle = agent.initialize_xfer("READ", local_descs, remote_descs, peer, notif_msg=notif)
            except Exception as exc:
                return None, "FAILED", repr(exc)
            marks["made"] = time.perf_counter()
            try:
                state = agent.transfer(handle)
                marks["posted"] = time.perf_counter()
                # A READ on one host often ends within a millisecond (CUDA IPC runs at
                # HBM speed: 1 GB in 0.7 ms on an H100). Polling it here first, on the
                # agent's thread, sees that at once; the event loop's backed-off polling
                # below alone added more than a millisecond to every such READ.
                spin_until = time.monotonic() + self._spin_s
                while state == "PROC" and time.monotonic() < spin_until:
                    time.sleep(0)  # let the event loop's thread have the GIL between polls
                    state = agent.check_xfer_state(handle)
                marks["spun"] = time.perf_counter()
            except Exception as exc:
                # e.g. NIXL_ERR_REMOTE_DISCONNECT: the holder died after we loaded its metadata.
                return self._release(handle), "ERR", repr(exc)
            if state == "DONE":
                marks["ended"] = time.monotonic()
                # Finished while polled here: release it here too, saving the two
                # thread hops (about 0.1 ms each) of the event loop's way below.
                handle.release()
                marks["done"] = marks["released"] = time.perf_counter()
                return None, state, ""
            if state != "PROC":  # ERR: released here like a raising transfer
                return self._release(handle), state, ""
            return handle, state, ""

        try:
            handle, state, error = await asyncio.wait_for(self.call(post), max(0.001, until - time.monotonic()))
        except TimeoutError:
            # The thread may still be posting: count it as started and never cancelled.
            return ReadOutcome("PROC", posted=True, released=False, error="post timed out")
        if state == "FAILED":  # no transfer was made
            return ReadOutcome(state, posted=False, released=True, error=error)
        if state == "ERR":  # release tried once on the agent's thread; kept until close if it failed
            return ReadOutcome(state, posted=True, released=handle is None, error=error)
        if handle is None:  # done and released on the agent's thread
            return ReadOutcome(state, posted=True, released=True, ended=marks["ended"], phases=_phases(marks))
        delay = 0.0001
        while state == "PROC" and time.monotonic() < until:
            await asyncio.sleep(delay)
            # A READ's end is seen up to one delay late: 4 GB over NVLink (12 ms) ended
            # 8.4 ms after the spin (p50) with 2 ms between polls. A poll is one thread hop.
            delay = min(delay * 2, _POLL_MAX_S)
            state, error = await self.call(_poll, agent, handle)
        ended = time.monotonic()
        marks["done"] = time.perf_counter()
        if await self.call(self._release, handle) is not None:
            log.error("nixl_xfer_not_cancelled", peer=peer, state=state)
            return ReadOutcome(state, posted=True, released=False, error=error or "release failed")
        marks["released"] = time.perf_counter()
        phases = _phases(marks) if state == "DONE" else {}
        return ReadOutcome(state, posted=True, released=True, error=error, ended=ended, phases=phases)

    def _release(self, handle: Any) -> Any:
        """Release (cancel) a transfer on the agent's thread; None when done,
        else the handle, kept until close: dropped anywhere else, its
        destructor would call into NIXL from that thread."""
        try:
            handle.release()
            return None
        except Exception as exc:
            log.warning("nixl_release_failed", agent=self.name, error=repr(exc))
            self._unreleased.append(handle)
            return handle

    async def close(self) -> None:
        if self._agent is not None:
            agent, self._agent = self._agent, None
            # UCX must purge what a dead peer's endpoint still queues before it is torn
            # down: destroyed at once, it can abort the process (ucs_arbiter assertion).
            for _ in range(_SETTLE_POLLS):
                await self.call(agent.get_new_notifs)
                await asyncio.sleep(0.005)
            stuck, self._unreleased = self._unreleased, []
            for handle in stuck:
                await self.call(self._release, handle)
            # Still unreleased: dropped here, on the agent's thread, before the agent.
            await self.call(self._unreleased.clear)
            for registered in self._registered:
                try:
                    await self.call(agent.deregister_memory, registered)
                except Exception as exc:
                    log.warning("nixl_deregister_failed", agent=self.name, error=repr(exc))
            # Drop the last reference on the agent's thread: its destructor tears UCX down.
            doomed = [agent]
            del agent
            await self.call(doomed.clear)
        self._thread.shutdown(wait=False)


def _poll(agent: Any, handle: Any) -> tuple[str, str]:
    try:
        state: str = agent.check_xfer_state(handle)
        return state, ""
    except Exception as exc:  # e.g. the holder disconnected mid-READ
        return "ERR", repr(exc)


def _phases(marks: dict[str, float]) -> dict[str, float]:
    order = ["start", "thread", "made", "posted", "spun", "done", "released"]
    names = ["to_thread", "make", "post", "spin", "loop_poll", "release"]
    return {n: marks[b] - marks[a] for n, a, b in zip(names, order[:-1], order[1:], strict=True)}
