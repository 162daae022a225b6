"""Reply streams: publishing chunks with ``seq``, reading back what a request
already emitted (for a takeover), relaying each token exactly once."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from pipeline.subjects import Subjects
from schemas.chunk import ErrorChunk, ImageChunk, ReplyChunk, TokenChunk
from schemas.codec import CONTENT_TYPE, MSGPACK, Decoder, encode

log = structlog.get_logger(__name__)

CHUNK_DECODER: Decoder[ReplyChunk] = Decoder(ReplyChunk)


def is_final(chunk: ReplyChunk) -> bool:
    if isinstance(chunk, ImageChunk):
        return chunk.last
    return isinstance(chunk, ErrorChunk) or chunk.finish_reason is not None


@dataclass
class Emitted:
    """What a reply subject holds for one request."""

    token_ids: list[int] = field(default_factory=list)
    finished: bool = False


class ReplyPublisher:
    def __init__(self, nc: Client, js: JetStreamContext, subjects: Subjects) -> None:
        self._nc = nc
        self._js = js
        self._subjects = subjects

    def is_stored(self, request_id: str, reply_subject: str) -> bool:
        return reply_subject == self._subjects.reply(request_id)

    async def publish(self, reply_subject: str, chunk: ReplyChunk) -> None:
        data = encode(chunk)
        if not self.is_stored(chunk.request_id, reply_subject):
            # A caller's own subject: core NATS, no stored copy.
            await self._nc.publish(reply_subject, data, headers={CONTENT_TYPE: MSGPACK})
            return
        tag = (
            "error"
            if isinstance(chunk, ErrorChunk)
            else f"image.{chunk.index}"
            if isinstance(chunk, ImageChunk)
            else f"{chunk.seq}"
        )
        # The stream's duplicate window drops a retried publish of the same chunk.
        headers = {CONTENT_TYPE: MSGPACK, "Nats-Msg-Id": f"{chunk.request_id}:reply:{tag}"}
        await self._js.publish(reply_subject, data, headers=headers)

    async def read_emitted(self, request_id: str) -> Emitted:
        """Tokens stored for a request, in order, without duplicates."""
        subject = self._subjects.reply(request_id)
        stream = self._subjects.reply_stream
        try:
            last = await self._js.get_last_msg(stream, subject)
        except NotFoundError:
            return Emitted()
        last_chunk = CHUNK_DECODER.decode(last.data or b"", (last.headers or {}).get(CONTENT_TYPE))
        if is_final(last_chunk):
            return Emitted(finished=True)
        if not isinstance(last_chunk, TokenChunk):
            return Emitted()  # images part way: a takeover draws them all again, from the same seed
        total = last_chunk.end
        tokens: list[int] = []
        sub = await self._js.pull_subscribe(
            subject,
            stream=stream,
            config=ConsumerConfig(
                deliver_policy=DeliverPolicy.ALL,
                ack_policy=AckPolicy.NONE,
                inactive_threshold=30.0,
            ),
        )
        try:
            while len(tokens) < total:
                for msg in await sub.fetch(256, timeout=2.0):
                    chunk = CHUNK_DECODER.decode(msg.data, (msg.headers or {}).get(CONTENT_TYPE))
                    if isinstance(chunk, TokenChunk) and chunk.seq == len(tokens):
                        tokens.extend(chunk.token_ids)
        finally:
            await sub.unsubscribe()
        log.info("reply_resumed", request_id=request_id, emitted=len(tokens))
        return Emitted(token_ids=tokens[:total])


async def stored_chunks(js: JetStreamContext, subjects: Subjects, request_id: str) -> list[ReplyChunk]:
    """Every chunk the reply stream holds for a request, in order: what a
    relay missed while it was away from NATS (a reconnect) is there."""
    subject = subjects.reply(request_id)
    stream = subjects.reply_stream
    try:
        last = await js.get_last_msg(stream, subject)
    except NotFoundError:
        return []
    chunks: list[ReplyChunk] = []
    last_seq = last.seq or 0
    sub = await js.pull_subscribe(
        subject,
        stream=stream,
        config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE, inactive_threshold=30.0),
    )
    try:
        seen = 0
        while seen < last_seq:
            for msg in await sub.fetch(256, timeout=2.0):
                seen = max(seen, msg.metadata.sequence.stream)
                chunks.append(CHUNK_DECODER.decode(msg.data, (msg.headers or {}).get(CONTENT_TYPE)))
    finally:
        await sub.unsubscribe()
    return chunks


class ExactlyOnceRelay:
    """Drops any chunk whose tokens were already relayed (a takeover after a
    crash resumes at the next ``seq``, but a redelivered publish may repeat)."""

    def __init__(self, text_then_images: bool = False) -> None:
        self.next_seq = 0
        self.done = False
        self.images: set[int] = set()
        # A route with an image stage after the text: done once both are.
        self._text_then_images = text_then_images
        self._text_done = False
        self._images_done = False

    def is_gap(self, chunk: ReplyChunk) -> bool:
        """A chunk past the next expected token: some came while we were not listening."""
        return isinstance(chunk, TokenChunk) and chunk.seq > self.next_seq

    def accept(self, chunk: ReplyChunk) -> ReplyChunk | None:
        if self.done:
            return None
        if isinstance(chunk, ErrorChunk):
            self.done = True
            return chunk
        if isinstance(chunk, ImageChunk):
            # Whole images, by index: a redrawn one (a takeover) is a repeat.
            if chunk.index in self.images:
                return None
            self.images.add(chunk.index)
            self._images_done = len(self.images) == chunk.count
            self.done = self._images_done and (self._text_done or not self._text_then_images)
            return chunk
        if chunk.seq > self.next_seq:
            # Emitters never skip: a gap is a bug to shout about, not to hide.
            log.error("reply_gap", request_id=chunk.request_id, expected=self.next_seq, got=chunk.seq)
        elif chunk.seq < self.next_seq:
            if chunk.end <= self.next_seq:
                return None  # a repeat of what was relayed
            skip = self.next_seq - chunk.seq
            # Text of a partial overlap cannot be split at a token boundary.
            chunk = msgspec.structs.replace(chunk, seq=self.next_seq, token_ids=chunk.token_ids[skip:], text="")
        self.next_seq = chunk.end
        self._text_done = chunk.finish_reason is not None
        self.done = self._text_done and (self._images_done or not self._text_then_images)
        return chunk
