"""Moving a routed hop back to its role's shared queue."""

from __future__ import annotations

from typing import Final

import msgspec
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from prometheus_client import Counter

from pipeline.subjects import Subjects
from schemas.codec import CONTENT_TYPE, MSGPACK, encode
from schemas.processed import ProcessedRequest

log = structlog.get_logger(__name__)

REQUEUED: Final = Counter(
    "mmpipe_routed_requeued_total",
    "Hops sent to one worker that went back to the shared queue, by why: waited (not started in time), "
    "drained (the worker stopped) or rescued (the worker was gone)",
    ["role", "why"],
)
_KEPT_HEADERS = ("traceparent", "tracestate")


async def requeue(js: JetStreamContext, subjects: Subjects, role: str, msg: Msg, why: str) -> None:
    """Publish ``msg`` to ``role``'s shared subject, then ack it where it
    was. A crash between the two leaves both: the copy's message id (the
    original's stream sequence) makes a second requeue of it a duplicate
    the stream drops. A hop a worker may have started (a gone worker's, or
    one delivered before) may have streamed tokens: the copy says so, and
    its taker reads them first."""
    data = msg.data
    # Delivered before (a drained worker's unfinished hop, handed back to
    # its own consumer), or a gone worker's: it may have streamed tokens.
    if why == "rescued" or (msg.metadata.num_delivered or 1) > 1:
        out = msgspec.msgpack.decode(data, type=ProcessedRequest)
        data = encode(msgspec.structs.replace(out, redelivered=True))
    original = (msg.headers or {}).get("Nats-Msg-Id", "")
    headers = {CONTENT_TYPE: MSGPACK, "Nats-Msg-Id": f"{original}:{why[0]}{msg.metadata.sequence.stream}"}
    headers.update({k: v for k, v in (msg.headers or {}).items() if k in _KEPT_HEADERS})
    await js.publish(subjects.work(role), data, headers=headers)
    await msg.ack()
    REQUEUED.labels(role, why).inc()
    log.info("routed_hop_requeued", role=role, why=why, msg_id=original)
