"""Idempotent provisioning of the namespace's streams and consumers: every
process may run it at start, in any order, any number of times."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import structlog
from nats.errors import ConnectionClosedError, ConnectionReconnectingError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    Placement,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import APIError, NoStreamResponseError, NotFoundError, ServiceUnavailableError

from pipeline.config import PipelineConfig, StreamLimits
from pipeline.subjects import Subjects
from schemas.routes import PROCESSOR, STAGE_ROLES

log = structlog.get_logger(__name__)

# JetStream API error codes for a stream at its max_msgs / max_bytes.
_STREAM_FULL_CODES = {10077, 10078}
_STREAM_FULL_TEXT = ("maximum messages exceeded", "maximum bytes exceeded")

# JetStream API error code for "stream name already in use with a different configuration".
_STREAM_EXISTS_DIFFERENT = 10058
# Answers that mean "not now" while a cluster elects leaders, a node is down
# or another process reconfigures the same stream: provisioning retries them.
_NOT_NOW_CODES = {
    10005,  # no suitable peers for placement: a peer not (yet) seen online, as a cluster forms
    10008,  # JetStream system temporarily unavailable
    10023,  # insufficient resources (a node of the placement is down)
    10226,  # stream reconfiguration already in progress
}
_NOT_NOW = (
    NatsTimeoutError,
    NoRespondersError,
    NoStreamResponseError,
    ServiceUnavailableError,
    ConnectionClosedError,
    ConnectionReconnectingError,
)
# The fields mmpipe sets on a stream: an existing stream is compared on these.
_STREAM_FIELDS = (
    "subjects",
    "retention",
    "storage",
    "max_msgs",
    "max_bytes",
    "max_age",
    "discard",
    "duplicate_window",
    "num_replicas",
    "placement",
)
_CONSUMER_FIELDS = ("filter_subject", "ack_policy", "deliver_policy", "ack_wait", "max_deliver", "max_ack_pending")

T = TypeVar("T")


class ProvisioningConflict(RuntimeError):
    """A stream or consumer exists with a configuration JetStream cannot
    change in place (retention, storage, deliver policy, ...), or one the
    cluster cannot hold (more replicas than nodes, a placement nobody
    matches). Not retryable: an operator must delete or migrate it."""


def _work_queue(name: str, subjects: list[str], limits: StreamLimits) -> StreamConfig:
    return StreamConfig(
        name=name,
        subjects=subjects,
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        max_msgs=limits.max_msgs,
        max_bytes=limits.max_bytes,
        # Full means the producer hears about it (429 at the bridge), never
        # that queued work is dropped.
        discard=DiscardPolicy.NEW,
        duplicate_window=limits.duplicate_window_s,
    )


def _placed(cfg: StreamConfig, config: PipelineConfig) -> StreamConfig:
    placement = config.placement
    return dataclasses.replace(
        cfg,
        num_replicas=config.replicas,
        placement=Placement(cluster=placement.cluster, tags=list(placement.tags) or None) if placement else None,
    )


def stream_configs(config: PipelineConfig) -> list[StreamConfig]:
    """Every stream of the namespace. ``num_replicas`` / ``placement`` are
    None where the config leaves them to what exists (see PipelineConfig)."""
    s = config.subjects
    streams = [_work_queue(s.stream(PROCESSOR), [s.requests], config.request_queue_limits)]
    # A hop's queue holds the shared subject every worker of the role takes
    # from, and one subject per worker that a cache-aware router sends to.
    streams += [
        _work_queue(s.stream(role), [s.work(role), s.all_routed(role)], config.hop_limits) for role in STAGE_ROLES
    ]
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
    return [_placed(cfg, config) for cfg in streams]


async def retrying(what: str, call: Callable[[], Awaitable[T]], timeout_s: float) -> T:
    """``call`` until it answers or fails for good; "not now" answers (no
    JetStream leader yet, a node down, a reconnect, a concurrent
    reconfiguration) are retried with backoff for ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    delay = 0.1
    while True:
        try:
            return await call()
        except Exception as exc:
            if not is_not_now(exc):
                raise
            error = exc
        if time.monotonic() + delay > deadline:
            raise error
        log.info("provisioning_retry", what=what, error=repr(error))
        await asyncio.sleep(delay)
        delay = min(2.0, delay * 2)


def _differences(want: dict[str, Any], have: dict[str, Any], fields: tuple[str, ...]) -> dict[str, tuple[Any, Any]]:
    return {k: (have.get(k), want[k]) for k in fields if k in want and want[k] != have.get(k)}


async def ensure_stream(js: JetStreamContext, cfg: StreamConfig, timeout_s: float = 60.0) -> None:
    """Create the stream, or converge an existing one on ``cfg``. Safe when
    many processes run it at once: an identical create succeeds for each,
    and all of them update towards the same configuration."""
    try:
        await retrying(cfg.name or "", lambda: js.add_stream(cfg), timeout_s)
        return
    except APIError as exc:
        if exc.err_code != _STREAM_EXISTS_DIFFERENT:
            raise _conflict(cfg.name, exc) from exc
    info = await retrying(cfg.name or "", lambda: js.stream_info(cfg.name or ""), timeout_s)
    # Replicas and placement left open (None) keep what the stream has.
    want = dataclasses.replace(
        cfg,
        num_replicas=cfg.num_replicas if cfg.num_replicas is not None else info.config.num_replicas,
        placement=cfg.placement if cfg.placement is not None else info.config.placement,
    )
    changed = _differences(want.as_dict(), info.config.as_dict(), _STREAM_FIELDS)
    if not changed:
        return
    try:
        await retrying(want.name or "", lambda: js.update_stream(want), timeout_s)
    except APIError as exc:
        raise _conflict(cfg.name, exc, changed) from exc
    log.info("stream_updated", stream=cfg.name, changed={k: f"{a} -> {b}" for k, (a, b) in changed.items()})


def _conflict(name: str | None, exc: APIError, changed: dict[str, tuple[Any, Any]] | None = None) -> Exception:
    if exc.err_code in _NOT_NOW_CODES:
        return exc
    refused = f"{name}: JetStream refused the configuration this process asks for"
    if not changed:
        return ProvisioningConflict(f"{refused}: {exc.description} (error {exc.err_code})")
    diff = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items())
    return ProvisioningConflict(
        f"{refused} ({diff}): {exc.description} (error {exc.err_code}). "
        "Delete or migrate the existing one, or start with the settings it has."
    )


async def ensure_streams(js: JetStreamContext, config: PipelineConfig) -> None:
    for cfg in stream_configs(config):
        await ensure_stream(js, cfg)


def consumer_config(config: PipelineConfig, role: str) -> ConsumerConfig:
    s = config.subjects
    c = config.consumer_for(role)
    return ConsumerConfig(
        durable_name=s.durable(role),
        filter_subject=s.work(role),
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=c.ack_wait_s,
        max_deliver=c.max_deliver,
        max_ack_pending=c.max_ack_pending,
    )


def routed_consumer_config(config: PipelineConfig, role: str, worker_id: str) -> ConsumerConfig:
    """A worker's own consumer of what a router sent it. It outlives the
    worker by ``orphan_after_s`` of no pulls: the subject is then free for
    a rescuer to move what is left back to the shared queue."""
    s = config.subjects
    c = config.consumer_for(role)
    return ConsumerConfig(
        durable_name=s.routed_durable(role, worker_id),
        filter_subject=s.routed(role, worker_id),
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=c.ack_wait_s,
        max_deliver=c.max_deliver,
        max_ack_pending=c.max_ack_pending,
        inactive_threshold=config.router.orphan_after_s,
    )


async def ensure_consumer(
    js: JetStreamContext, config: PipelineConfig, role: str, timeout_s: float = 60.0
) -> ConsumerConfig:
    """Create or update the role's durable (its replicas follow the
    stream's). Several workers of a role starting at once all succeed; the
    settings of the one that starts last are the ones in force, so give
    every worker of a role the same ones."""
    cfg = consumer_config(config, role)
    stream = config.subjects.stream(role)
    # CONSUMER.CREATE without an action creates or updates a durable.
    try:
        info = await retrying(cfg.durable_name or "", lambda: js.add_consumer(stream, cfg), timeout_s)
    except APIError as exc:
        raise _conflict(f"{stream} consumer {cfg.durable_name}", exc) from exc
    changed = _differences(cfg.as_dict(), info.config.as_dict(), _CONSUMER_FIELDS)
    if changed:
        log.warning("consumer_settings_differ", consumer=cfg.durable_name, changed=str(changed))
    return cfg


async def consumer_exists(js: JetStreamContext, subjects: Subjects, role: str) -> bool:
    try:
        await js.consumer_info(subjects.stream(role), subjects.durable(role))
    except NotFoundError:
        return False
    return True


def is_not_now(error: BaseException) -> bool:
    """JetStream could not answer now but may soon: no stream leader while a
    cluster elects one, a node down, a reconnect under way. Not a full
    stream: nats-py raises ServiceUnavailableError (503) for that too."""
    if isinstance(error, APIError):
        if is_stream_full(error):
            return False
        return error.err_code in _NOT_NOW_CODES or isinstance(error, ServiceUnavailableError)
    return isinstance(error, _NOT_NOW)


def is_stream_full(error: APIError) -> bool:
    return error.err_code in _STREAM_FULL_CODES or any(t in (error.description or "") for t in _STREAM_FULL_TEXT)
