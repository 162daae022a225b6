"""Settling a work message once its stage is done: ack, nak with a delay, or
reject (terminate, tell the client with an error chunk, record the message
on the dead subject so an operator can replay it)."""

from __future__ import annotations

from typing import Any

import msgspec
import structlog
from nats.aio.msg import Msg
from nats.errors import MaxPayloadError
from nats.js import JetStreamContext

from pipeline import metrics
from pipeline.outcomes import Ack, Nak, Outcome
from pipeline.replies import ReplyPublisher
from pipeline.subjects import Subjects, check_token
from schemas.chunk import ErrorChunk
from schemas.codec import CONTENT_TYPE, Decoder, encode
from schemas.control import DeadLetter
from schemas.errors import Cancelled
from schemas.processed import ProcessedRequest
from schemas.request import GenerateRequest

log = structlog.get_logger(__name__)


class _Envelope(msgspec.Struct):
    """Just enough of any request to tell its client what went wrong when
    the rest of it does not decode."""

    request_id: str = ""
    reply_subject: str | None = None
    request: dict[str, Any] | None = None


_ENVELOPE: Decoder[_Envelope] = Decoder(_Envelope)


class Settler:
    def __init__(self, js: JetStreamContext, replies: ReplyPublisher, subjects: Subjects, role: str) -> None:
        self.js = js
        self.replies = replies
        self.subjects = subjects
        self.role = role

    async def settle(
        self, msg: Msg, message: GenerateRequest | ProcessedRequest | None, outcome: Outcome, deliveries: int
    ) -> None:
        metrics.MESSAGES.labels(self.role, type(outcome).__name__.lower()).inc()
        if isinstance(outcome, Ack):
            await msg.ack()
            return
        error = outcome.error
        metrics.ERRORS.labels(self.role, error.code.value).inc()
        if isinstance(outcome, Nak):
            log.warning("retrying", role=self.role, code=error.code.value, error=error.message, deliveries=deliveries)
            await msg.nak(delay=outcome.delay_s)
            return
        log.warning("rejected", role=self.role, code=error.code.value, error=error.message, deliveries=deliveries)
        request_id, reply_subject = self._reply_target(msg, message)
        if reply_subject and not isinstance(error, Cancelled):
            try:
                await self.replies.publish(reply_subject, ErrorChunk.from_error(request_id, error))
            except Exception as exc:
                metrics.ERRORS.labels(self.role, "reply_failed").inc()
                log.error("error_reply_failed", role=self.role, error=repr(exc))
        dead = DeadLetter(
            subject=msg.subject,
            code=error.code,
            message=error.message,
            deliveries=deliveries,
            request_id=request_id,
            payload=msg.data,
        )
        try:
            try:
                await self.js.publish(self.subjects.dead, encode(dead))
            except MaxPayloadError:
                # A message near the size limit is too big with the letter
                # around it: record the request without its bytes rather than
                # not at all.
                dead = msgspec.structs.replace(dead, payload=b"", payload_omitted=len(msg.data))
                await self.js.publish(self.subjects.dead, encode(dead))
            metrics.DEAD.labels(self.role, error.code.value).inc()
        except Exception as exc:
            metrics.ERRORS.labels(self.role, "dead_letter_failed").inc()
            log.error("dead_letter_failed", role=self.role, error=repr(exc))
        await msg.term()

    def _reply_target(self, msg: Msg, message: GenerateRequest | ProcessedRequest | None) -> tuple[str, str | None]:
        if message is not None:
            request = message.request if isinstance(message, ProcessedRequest) else message
            return request.request_id, request.reply_subject or self._stored_reply(request.request_id)
        try:
            env = _ENVELOPE.decode(msg.data, (msg.headers or {}).get(CONTENT_TYPE))
        except (msgspec.DecodeError, msgspec.ValidationError):
            return "", None
        if env.request and not env.request_id:
            env = _Envelope(
                request_id=str(env.request.get("request_id", "")), reply_subject=env.request.get("reply_subject")
            )
        return env.request_id, env.reply_subject or self._stored_reply(env.request_id)

    def _stored_reply(self, request_id: str) -> str | None:
        try:
            check_token(request_id, "request_id")
        except ValueError:
            return None
        return self.subjects.reply(request_id)
