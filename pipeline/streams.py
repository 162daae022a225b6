"""Idempotent provisioning of the namespace's streams and consumers: every
process may run it at start, in any order, any number of times."""

from __future__ import annotations

import structlog
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import APIError, BadRequestError, NotFoundError

from pipeline.config import PipelineConfig, StreamLimits
from pipeline.subjects import Subjects
from schemas.routes import HOP_ROLES, PROCESSOR

log = structlog.get_logger(__name__)

# JetStream API error codes for a stream at its max_msgs / max_bytes.
_STREAM_FULL_CODES = {10077, 10078}
_STREAM_FULL_TEXT = ("maximum messages exceeded", "maximum bytes exceeded")

# JetStream API error code for "stream name already in use with a different configuration".
_STREAM_EXISTS_DIFFERENT = 10058


def _work_queue(name: str, subject: str, limits: StreamLimits) -> StreamConfig:
    return StreamConfig(
        name=name,
        subjects=[subject],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        max_msgs=limits.max_msgs,
        max_bytes=limits.max_bytes,
        # Full means the producer hears about it (429 at the bridge), never
        # that queued work is dropped.
        discard=DiscardPolicy.NEW,
        duplicate_window=limits.duplicate_window_s,
    )


def stream_configs(config: PipelineConfig) -> list[StreamConfig]:
    s = config.subjects
    streams = [_work_queue(s.stream(PROCESSOR), s.requests, config.requests_limits)]
    streams += [_work_queue(s.stream(role), s.work(role), config.hop_limits) for role in HOP_ROLES]
    streams.append(
        StreamConfig(
            name=s.reply_stream,
            subjects=[s.replies],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_age=config.reply_max_age_s,
            duplicate_window=min(config.reply_max_age_s, 120.0),
        )
    )
    streams.append(
        StreamConfig(
            name=s.dead_stream,
            subjects=[s.dead],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_age=config.dead_max_age_s,
            max_msgs=100_000,
            discard=DiscardPolicy.OLD,
        )
    )
    return streams


async def ensure_stream(js: JetStreamContext, cfg: StreamConfig) -> None:
    try:
        await js.add_stream(cfg)
    except BadRequestError as exc:
        if exc.err_code != _STREAM_EXISTS_DIFFERENT:
            raise
        # Converge on the configuration this version asks for.
        await js.update_stream(cfg)
        log.info("stream_updated", stream=cfg.name)


async def ensure_streams(js: JetStreamContext, config: PipelineConfig) -> None:
    for cfg in stream_configs(config):
        await ensure_stream(js, cfg)


def consumer_config(config: PipelineConfig, role: str) -> ConsumerConfig:
    s = config.subjects
    c = config.consumer
    return ConsumerConfig(
        durable_name=s.durable(role),
        filter_subject=s.work(role),
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=c.ack_wait_s,
        max_deliver=c.max_deliver,
        max_ack_pending=c.max_ack_pending,
    )


async def ensure_consumer(js: JetStreamContext, config: PipelineConfig, role: str) -> ConsumerConfig:
    cfg = consumer_config(config, role)
    stream = config.subjects.stream(role)
    # CONSUMER.CREATE without an action creates or updates a durable: safe
    # when several workers of a role start at once.
    await js.add_consumer(stream, cfg)
    return cfg


async def consumer_exists(js: JetStreamContext, subjects: Subjects, role: str) -> bool:
    try:
        await js.consumer_info(subjects.stream(role), subjects.durable(role))
    except NotFoundError:
        return False
    return True


def is_stream_full(error: APIError) -> bool:
    return error.err_code in _STREAM_FULL_CODES or any(t in (error.description or "") for t in _STREAM_FULL_TEXT)
