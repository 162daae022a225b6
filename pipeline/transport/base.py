"""The tensor transport interface, its settings and its errors.

A worker ``put``s tensors and gets a small ``TensorRef`` to send along in its
message; the next worker ``get``s them into its own memory, which tells the
holder it may free them. Every transport behaves the same way towards the
worker runtime, so a stage never knows whether NIXL or the NATS object store
moved its tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from schemas.errors import ErrorCode, MmpipeError
from schemas.errors import TargetTainted as TargetTainted  # re-exported: the transports raise them
from schemas.errors import TensorGone as TensorGone
from schemas.settings import setting
from schemas.tensors import TensorRef

if TYPE_CHECKING:  # the bridge imports this module and never needs torch
    import torch

    from pipeline.transport.packing import Target


class ForeignTensorRef(MmpipeError):
    """A ref whose holder is no agent of this worker's namespace (it never
    published metadata in the namespace's bucket), or whose holder name could
    not be one. Refused, not read and not retried: tensors move only between
    agents of one namespace."""

    code = ErrorCode.INVALID_REQUEST
    http_status = 400


class TransportFull(MmpipeError):
    """The holder's byte budget stayed exhausted for the whole bounded wait in
    ``put``, or the tensors are larger than the whole budget. Retryable: the
    message goes back to the queue and another worker (or this one, later) may
    have room."""

    code = ErrorCode.OVERLOADED
    http_status = 503
    retryable = True


class TransportUnavailable(MmpipeError):
    """The transport cannot run in this process (e.g. NIXL is not installed).
    Not retryable: it is a deployment problem, fixed by installing or choosing
    another transport."""

    code = ErrorCode.INTERNAL
    http_status = 500


@dataclass(frozen=True)
class TransportSettings:
    # Bytes this process may hold for readers at once; for NIXL it is also the
    # size of the one registered arena.
    budget_bytes: int = setting(
        256 * 1024 * 1024,
        flag="tensor-budget-mb",
        unit=1 << 20,
        help="MiB of tensors a worker holds for the next hop's readers at most (it stops fetching at it)",
    )
    # NIXL: size of the registered arena a reader READs into; None = budget.
    recv_bytes: int | None = None
    # A region nobody read is freed after this long, so a dead reader leaks nothing.
    ttl_s: float = setting(60.0, flag="tensor-ttl", help="seconds before tensors nobody read are freed")
    # How long put waits for room before it raises TransportFull.
    # As long as the TTL: within it every held region is read or expires, so
    # a put that waits this long was not starved by readers but by a peer
    # gone wrong. The worker's heartbeats keep the message meanwhile; giving
    # it back sooner would spend a delivery of max_deliver on back-pressure.
    put_wait_s: float = 60.0
    # The longest a get may take in all, lookups and transfer included.
    get_timeout_s: float = 10.0
    # NIXL: how long a holder pins a region for a reader that asked to read it.
    # Longer than get_timeout_s, so a reader always gives up first.
    lease_s: float = 15.0
    # Control-plane round trips (lease request, metadata lookup).
    request_timeout_s: float = 2.0
    # NIXL: run UCX's progress thread. NIXL 1.5.1 runs it without a delay, so
    # it spins a whole core even when idle; without it, transfers progress when
    # the reader polls its READ and the holder polls for notifications.
    progress_thread: bool = setting(
        False,
        flag="nixl-progress-thread",
        help="UCX's progress thread in the NIXL agent: READs of this worker's tensors complete at once instead "
        "of at its next poll (about 1 ms), at the cost of a CPU core it keeps busy",
    )
    # Copies of the JetStream bucket the transport keeps (NIXL: the agents'
    # metadata; nats: the tensors), like the streams' --replicas.
    replicas: int = 1

    def __post_init__(self) -> None:
        if self.budget_bytes <= 0:
            raise ValueError("budget_bytes must be positive")
        if self.lease_s <= self.get_timeout_s:
            raise ValueError("lease_s must be longer than get_timeout_s: a reader must give up before its lease ends")


@runtime_checkable
class TensorTransport(Protocol):
    """Moves packed tensors between workers. Used from one asyncio loop."""

    name: str
    # (bytes, seconds) of this object's last completed put or get, for the
    # caller's per-request trace line.
    last_transfer: tuple[int, float]

    async def start(self) -> None:
        """Create what the transport needs (agent, arena, buckets) and publish it."""
        ...

    async def put(self, tensors: list[torch.Tensor], *, owner: str) -> TensorRef:
        """Hold a copy of ``tensors`` for one reader. ``owner`` (a request id)
        is for logs and metrics. Raises TransportFull."""
        ...

    async def get(self, ref: TensorRef, device: torch.device | str = "cpu") -> list[torch.Tensor]:
        """Fresh tensors owned by the caller; the holder may then free its
        copy. Raises TensorGone."""
        ...

    async def get_into(self, ref: TensorRef, targets: list[Target]) -> None:
        """The tensors written into the caller's ``targets`` (of the ref's
        dtypes and shapes; views allowed, or a tensor's pieces along its
        first dimension), where the transport can, without a copy of its
        own. Raises TensorGone, or TargetTainted when the targets may still
        be written after it."""
        ...

    async def release(self, ref: TensorRef) -> None:
        """Holder side: free now, e.g. the request was cancelled before anyone read it."""
        ...

    async def release_owner(self, owner: str) -> int:
        """Holder side: free everything held for ``owner`` (a request that was
        cancelled: nobody will read it). Returns how many regions."""
        ...

    def has_room(self, nbytes: int = 0) -> bool:
        """False when the held bytes (plus ``nbytes``) would exceed the budget:
        the worker then stops fetching new messages."""
        ...

    @property
    def held_bytes(self) -> int: ...

    async def close(self) -> None: ...
