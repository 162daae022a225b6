"""Settings shared by every process of a deployment."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pipeline.subjects import Subjects


@dataclass(frozen=True)
class StreamLimits:
    max_msgs: int = 10_000
    # Every bounded stream reserves its max_bytes from the JetStream file limit.
    max_bytes: int = 256 * 1024 * 1024
    # Retried publishes with the same Nats-Msg-Id inside this window are dropped.
    duplicate_window_s: float = 120.0


@dataclass(frozen=True)
class ConsumerSettings:
    """A role's durable consumer, shared by every worker of the role."""

    # Unacked this long, a message goes to another worker. Workers send
    # in_progress every ack_wait/3, so only a dead or cut-off worker hits it:
    # it is how long a crashed worker's requests wait before a takeover.
    ack_wait_s: float = 30.0
    # Deliveries of one message before it is dead-lettered (retryable
    # failures are naked with backoff until then).
    max_deliver: int = 5
    # Shared by all workers of a role: the most messages out at once.
    max_ack_pending: int = 1024


@dataclass(frozen=True)
class Placement:
    """Where JetStream puts a stream's replicas: a cluster by name and/or
    servers carrying all these tags (``server_tags`` in nats-server's config)."""

    cluster: str | None = None
    tags: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.cluster or self.tags)


@dataclass(frozen=True)
class PipelineConfig:
    # One URL, or several comma separated (the nodes of a cluster): the
    # client connects to any and reconnects across them.
    nats_url: str = "nats://127.0.0.1:4222"
    namespace: str = "default"
    mode: str = "epd"
    requests_limits: StreamLimits = field(default_factory=StreamLimits)
    hop_limits: StreamLimits = field(default_factory=StreamLimits)
    # Every role's consumer, unless ``role_consumers`` names the role.
    consumer: ConsumerSettings = field(default_factory=ConsumerSettings)
    role_consumers: Mapping[str, ConsumerSettings] = field(default_factory=dict)
    # Copies of each stream (3 on a 3-node cluster). None: 1 for a stream
    # this process creates, and an existing stream keeps what it has, so a
    # process started without the flag never shrinks a replicated stream.
    replicas: int | None = None
    # None: an existing stream keeps its placement.
    placement: Placement | None = None
    # Chunks stay this long in the reply stream: long enough for a takeover
    # to read what was emitted, short enough not to grow without bound.
    reply_max_age_s: float = 600.0
    dead_max_age_s: float = 7 * 24 * 3600.0
    # How long a stage waits for room in a full downstream stream before it
    # gives the message back, for a request without a deadline (one with a
    # deadline waits until it).
    full_stream_wait_s: float = 30.0
    # Attempts of a request from its first hop (a lost tensor restarts it)
    # before it is given up as dead.
    max_attempts: int = 3

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.namespace)

    def consumer_for(self, role: str) -> ConsumerSettings:
        return self.role_consumers.get(role, self.consumer)
