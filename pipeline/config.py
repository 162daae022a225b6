"""Settings shared by every process of a deployment."""

from __future__ import annotations

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
    ack_wait_s: float = 30.0
    max_deliver: int = 5
    # Shared by all workers of a role: the most messages out at once.
    max_ack_pending: int = 1024


@dataclass(frozen=True)
class PipelineConfig:
    nats_url: str = "nats://127.0.0.1:4222"
    namespace: str = "default"
    mode: str = "epd"
    requests_limits: StreamLimits = field(default_factory=StreamLimits)
    hop_limits: StreamLimits = field(default_factory=StreamLimits)
    consumer: ConsumerSettings = field(default_factory=ConsumerSettings)
    # Chunks stay this long in the reply stream: long enough for a takeover
    # to read what was emitted, short enough not to grow without bound.
    reply_max_age_s: float = 600.0
    dead_max_age_s: float = 7 * 24 * 3600.0
    # How long a stage waits for room in a full downstream stream before it
    # gives the message back.
    full_stream_wait_s: float = 5.0
    # Attempts of a request from its first hop (a lost tensor restarts it)
    # before it is given up as dead.
    max_attempts: int = 3

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.namespace)
