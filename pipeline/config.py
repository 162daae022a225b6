"""Settings shared by every process of a deployment."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pipeline.subjects import Subjects
from schemas.routes import MODES
from schemas.settings import section, setting

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


@dataclass(frozen=True)
class StreamLimits:
    max_msgs: int = setting(
        10_000,
        flag="queue-max-msgs",
        help="messages a work queue holds (a full request queue is the bridge's 429; a full inner one holds "
        "the upstream worker)",
    )
    # Every bounded stream reserves its max_bytes from the JetStream file limit.
    max_bytes: int = setting(256 * 1024 * 1024, flag="queue-max-bytes", help="bytes a work queue holds")
    # Retried publishes with the same Nats-Msg-Id inside this window are dropped.
    duplicate_window_s: float = 120.0

    def __post_init__(self) -> None:
        if self.max_msgs < 1 or self.max_bytes < 1:
            raise ValueError("--queue-max-msgs and --queue-max-bytes must be positive")


@dataclass(frozen=True)
class ConsumerSettings:
    """A role's durable consumer, shared by every worker of the role."""

    # Unacked this long, a message goes to another worker. Workers send
    # in_progress every ack_wait/3, so only a dead or cut-off worker hits it:
    # it is how long a crashed worker's requests wait before a takeover.
    ack_wait_s: float = setting(
        30.0,
        flag="ack-wait",
        help="seconds before a message a dead worker held goes to another worker (heartbeats every third of it)",
    )
    # Retryable failures are naked with backoff until then.
    max_deliver: int = setting(5, help="deliveries of a message before it is dead-lettered")
    max_ack_pending: int = setting(1024, help="messages out at once over all workers of a role")


@dataclass(frozen=True)
class Placement:
    """Where JetStream puts a stream's replicas: a cluster by name and/or
    servers carrying all these tags (``server_tags`` in nats-server's config)."""

    cluster: str | None = setting(None, flag="placement-cluster", help="the NATS cluster (by name) to place streams in")
    tags: tuple[str, ...] = setting(
        (), flag="placement-tags", help="place the streams on servers with all these server_tags (comma separated)"
    )

    def __bool__(self) -> bool:
        return bool(self.cluster or self.tags)


ROUTERS = ("round-robin", "kv")


@dataclass(frozen=True)
class RouterSettings:
    """Where a hop that prefills is sent (pipeline/router/)."""

    mode: str = setting(
        "round-robin",
        flag="router",
        choices=ROUTERS,
        help="kv: send a hop that prefills to the worker whose prefix cache holds most of its prompt, weighed "
        "against its load (workers relay their KV events on NATS); round-robin: the shared queue, whichever "
        "worker is free takes it",
    )
    overlap_weight: float = setting(
        1.0,
        flag="kv-overlap-score-weight",
        help="--router kv: a worker's cost is this times the prompt blocks it would prefill, plus the KV blocks "
        "it would then hold (NVIDIA Dynamo's cost); higher favours cache hits over spreading load",
    )
    routed_wait_s: float = setting(
        2.0,
        flag="routed-wait",
        help="--router kv: a hop sent to one worker that has not started it in S seconds goes back to the shared "
        "queue (the worker is busy or stopping)",
    )
    worker_silent_s: float = setting(
        3.0,
        flag="router-worker-silent",
        help="--router kv: a worker not heard from (its load, every half second) for S seconds is taken for gone: "
        "nothing more is sent to it, and what waits for it goes back to the shared queue",
    )
    # A worker's own consumer outlives the worker by this much of no pulls.
    orphan_after_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("routed_wait_s", "worker_silent_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name.removesuffix('_s').replace('_', '-')} must be positive")
        if self.overlap_weight < 0:
            raise ValueError("kv-overlap-score-weight must be at least 0")

    @property
    def kv(self) -> bool:
        return self.mode == "kv"


@dataclass(frozen=True)
class PipelineConfig:
    # One URL, or several comma separated (the nodes of a cluster): the
    # client connects to any and reconnects across them.
    nats_url: str = setting(
        DEFAULT_NATS_URL,
        help="a NATS server URL, or a cluster's URLs comma separated (reconnects across them); "
        "mmpipe up: an external server instead of its embedded one",
    )
    namespace: str = setting("default", help="keeps deployments on one NATS apart (subjects, streams, buckets)")
    mode: str = setting(
        "epd",
        choices=tuple(MODES),
        help="the route, which hops a request takes (in epd one worker does them all)",
    )
    # The work queues of every hop; the request queue too unless
    # ``requests_limits`` gives it its own.
    hop_limits: StreamLimits = section(StreamLimits, "JetStream work queues")
    requests_limits: StreamLimits | None = None
    # Every role's consumer, unless ``role_consumers`` names the role.
    consumer: ConsumerSettings = section(
        ConsumerSettings, "the durable consumer of each role (every worker of a role should agree)"
    )
    role_consumers: Mapping[str, ConsumerSettings] = field(default_factory=dict)
    # None: 1 for a stream this process creates, and an existing stream
    # keeps what it has, so a process started without it never shrinks a
    # replicated stream.
    replicas: int | None = setting(
        None,
        help="copies of each stream, 3 on a 3-node cluster (unset: 1 for a new stream, an existing one keeps its own)",
    )
    # Empty: an existing stream keeps its placement.
    placement: Placement = section(Placement, "where JetStream places the streams")
    router: RouterSettings = section(RouterSettings, "cache-aware routing")

    def __post_init__(self) -> None:
        if self.replicas is not None and self.replicas < 1:
            raise ValueError("--replicas must be at least 1")

    # Chunks stay this long in the reply stream: long enough for a takeover
    # to read what was emitted, short enough not to grow without bound.
    reply_max_age_s: float = 600.0
    dead_max_age_s: float = 7 * 24 * 3600.0
    # How long a stage waits for room in a full downstream stream before it
    # gives the message back, for a request without a deadline (one with a
    # deadline waits until it).
    full_stream_wait_s: float = 30.0
    # How long a stage holds a message whose output no stream answers for
    # now (a NATS node lost, its streams electing new leaders) before it
    # gives the message back; a request's deadline may end the wait sooner.
    # Not given back at once: the hop may already have read its input
    # tensors, which are read once, so its redelivery would restart the
    # request and spend one of its max_attempts on the outage.
    unavailable_wait_s: float = 30.0
    # Attempts of a request from its first hop (a lost tensor restarts it)
    # before it is given up as dead.
    max_attempts: int = 3
    # How long a hop waits for the bridge to queue a restart it asked for.
    restart_timeout_s: float = 5.0

    @property
    def request_queue_limits(self) -> StreamLimits:
        return self.requests_limits or self.hop_limits

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.namespace)

    def consumer_for(self, role: str) -> ConsumerSettings:
        return self.role_consumers.get(role, self.consumer)
