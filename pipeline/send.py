"""``mmpipe send``: one request over NATS, the way a NATS-native caller does it."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid

from pipeline.config import PipelineConfig
from pipeline.connection import connect
from pipeline.replies import CHUNK_DECODER, ExactlyOnceRelay
from schemas.chunk import ErrorChunk, as_text
from schemas.codec import CONTENT_TYPE, JSON, MSGPACK, encode
from schemas.request import ChatMessage, ContentPart, GenerateRequest, ImagePart, ImageURL, SamplingParams, TextPart


async def send(args: argparse.Namespace, config: PipelineConfig, source: str = "--nats-url") -> int:
    subjects = config.subjects
    rid = f"send-{uuid.uuid4().hex}"
    parts: list[ContentPart] = [ImagePart(ImageURL(url)) for url in args.image]
    parts.append(TextPart(args.prompt))
    request = GenerateRequest(
        request_id=rid,
        model=args.model,
        messages=[ChatMessage(role="user", content=parts)],
        sampling=SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature),
        created=time.time(),
        deadline=time.time() + 300,
    )
    content_type = JSON if args.json else MSGPACK
    try:
        nc, js = await asyncio.wait_for(connect(config.nats_url, name="mmpipe-send"), args.connect_timeout)
    except TimeoutError:
        print(
            f"mmpipe send: no NATS server answered at {config.nats_url} ({source}) within "
            f"{args.connect_timeout:g} s: start `mmpipe up` (it records its server in its --data-dir) or pass "
            "--nats-url",
            file=sys.stderr,
        )
        return 2
    try:
        sub = await nc.subscribe(subjects.reply(rid))
        await js.publish(
            subjects.requests, encode(request, content_type), headers={CONTENT_TYPE: content_type, "Nats-Msg-Id": rid}
        )
        relay = ExactlyOnceRelay()
        while not relay.done:
            msg = await sub.next_msg(timeout=300)
            accepted = relay.accept(CHUNK_DECODER.decode(msg.data, (msg.headers or {}).get(CONTENT_TYPE)))
            chunk = None if accepted is None else as_text(accepted)
            if isinstance(chunk, ErrorChunk):
                print(f"\nerror {chunk.http_status} {chunk.code.value}: {chunk.message}", file=sys.stderr)
                return 1
            if chunk is not None:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                if chunk.finish_reason is not None:
                    sys.stdout.write(f"\n[finish={chunk.finish_reason.value} usage={chunk.usage}]\n")
        return 0
    finally:
        await nc.drain()
