"""Contract tests of the worker runtime against a real nats-server, with a
small stage whose behaviour each request picks (no model needed)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, ClassVar

import pytest

from pipeline.config import ConsumerSettings, PipelineConfig, StreamLimits
from pipeline.connection import connect
from pipeline.replies import CHUNK_DECODER
from pipeline.streams import ensure_consumer, ensure_streams
from pipeline.worker import Worker
from schemas.chunk import ErrorChunk, FinishReason, ReplyChunk, TokenChunk
from schemas.codec import CONTENT_TYPE, Decoder, encode
from schemas.control import DeadLetter
from schemas.errors import ErrorCode, InvalidMedia, TensorGone, TransientError
from schemas.processed import ProcessedRequest
from schemas.request import ChatMessage, GenerateRequest
from stages.contract import HopContext, StageOutput
from tests.polling import eventually


class ScriptStage:
    """Streams one token per word of the prompt; words starting with '!'
    are commands: !bad, !retry, !sleep=S (between tokens)."""

    role = "processor"
    input_type = GenerateRequest
    resumes_stream = True

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[int]]] = []
        self.running = 0
        self.peak = 0
        self.finished: list[str] = []
        # False: the stage has no room for more (the worker fetches nothing).
        self.room = True

    @property
    def models(self) -> list[str]:
        return ["script"]

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def has_room(self) -> bool:
        return self.room

    async def run(
        self, message: GenerateRequest | ProcessedRequest, ctx: HopContext
    ) -> AsyncGenerator[StageOutput, None]:
        assert isinstance(message, GenerateRequest)
        self.calls.append((message.request_id, list(ctx.emitted)))
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            words = str(message.messages[0].content).split()
            sleep = 0.0
            for w in words:
                if w == "!bad":
                    raise InvalidMedia("the image is corrupt")
                if w == "!retry":
                    raise TransientError("try again")
                if w.startswith("!sleep="):
                    sleep = float(w.split("=")[1])
            tokens = [len(w) for w in words if not w.startswith("!")]
            for i in range(len(ctx.emitted), len(tokens)):
                await asyncio.sleep(sleep)
                last = i == len(tokens) - 1
                yield TokenChunk(message.request_id, i, [tokens[i]], f"w{i} ", FinishReason.STOP if last else None)
            self.finished.append(message.request_id)
        finally:
            self.running -= 1


def request(rid: str, text: str, **kw: Any) -> GenerateRequest:
    return GenerateRequest(request_id=rid, model="script", messages=[ChatMessage("user", text)], **kw)


async def collect(sub: Any, wait_s: float = 10.0) -> list[ReplyChunk]:
    chunks: list[ReplyChunk] = []
    while True:
        msg = await sub.next_msg(timeout=wait_s)
        chunk = CHUNK_DECODER.decode(msg.data, msg.headers.get(CONTENT_TYPE))
        chunks.append(chunk)
        if isinstance(chunk, ErrorChunk) or chunk.finish_reason is not None:
            return chunks


@pytest.fixture
async def running(pipeline_config: PipelineConfig) -> AsyncIterator[Any]:
    started: list[tuple[Worker, asyncio.Task[None], Any]] = []
    nc, js = await connect(pipeline_config.nats_url, "test-client")

    async def start(stage: ScriptStage, config: PipelineConfig = pipeline_config, **kw: Any) -> Worker:
        wnc, wjs = await connect(config.nats_url, "test-worker")
        worker = Worker(wnc, wjs, config, stage, **kw)
        task = asyncio.create_task(worker.run())
        started.append((worker, task, wnc))
        ready = asyncio.create_task(worker.ready.wait())
        await asyncio.wait([ready, task], timeout=10, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()  # raises what stopped the worker
        assert ready.done()
        return worker

    start.nc, start.js = nc, js  # type: ignore[attr-defined]
    yield start
    for worker, task, wnc in started:
        worker.stop()
        await asyncio.wait_for(task, 20)
        await wnc.close()
    await nc.close()


async def publish(js: Any, config: PipelineConfig, req: GenerateRequest) -> None:
    await js.publish(config.subjects.requests, encode(req))


async def dead_letters(js: Any, config: PipelineConfig, expect: int) -> list[DeadLetter]:
    """The dead letters, once ``expect`` of them are there (the client hears
    of an error before the worker records it)."""
    for _ in range(100):
        info = await js.stream_info(config.subjects.dead_stream)
        if info.state.messages >= expect:
            break
        await asyncio.sleep(0.05)
    decoder = Decoder(DeadLetter)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1) if info.state.messages else []:
        out.append(decoder.decode((await js.get_msg(config.subjects.dead_stream, seq)).data))
    return out


async def test_streams_chunks_in_order_and_acks(running: Any, pipeline_config: PipelineConfig) -> None:
    stage = ScriptStage()
    await running(stage)
    sub = await running.nc.subscribe(pipeline_config.subjects.reply("r1"))
    await publish(running.js, pipeline_config, request("r1", "a bb ccc"))
    chunks = await collect(sub)
    assert [(c.seq, c.token_ids) for c in chunks if isinstance(c, TokenChunk)] == [(0, [1]), (1, [2]), (2, [3])]
    await asyncio.sleep(0.2)
    info = await running.js.stream_info(pipeline_config.subjects.stream("processor"))
    assert info.state.messages == 0  # acked: the work queue let it go


async def test_bad_input_is_dead_lettered_once_and_worker_keeps_serving(
    running: Any, pipeline_config: PipelineConfig
) -> None:
    stage = ScriptStage()
    await running(stage)
    subjects = pipeline_config.subjects
    sub_bad = await running.nc.subscribe(subjects.reply("bad1"))
    await publish(running.js, pipeline_config, request("bad1", "x !bad"))
    [err] = await collect(sub_bad)
    assert isinstance(err, ErrorChunk)
    assert (err.code, err.http_status) == (ErrorCode.INVALID_MEDIA, 400)
    # Not even decodable: recorded, terminated, never redelivered.
    await running.js.publish(subjects.requests, b"\xc1 not msgpack", headers={CONTENT_TYPE: "application/msgpack"})
    sub_ok = await running.nc.subscribe(subjects.reply("ok1"))
    await publish(running.js, pipeline_config, request("ok1", "still here"))
    assert len(await collect(sub_ok)) == 2
    await asyncio.sleep(0.3)
    dead = await dead_letters(running.js, pipeline_config, 2)
    assert sorted(d.code for d in dead) == [ErrorCode.INVALID_MEDIA, ErrorCode.INVALID_REQUEST]
    assert [c[0] for c in stage.calls].count("bad1") == 1


async def test_retryable_failure_is_retried_then_dead_lettered(running: Any, pipeline_config: PipelineConfig) -> None:
    config = PipelineConfig(
        nats_url=pipeline_config.nats_url,
        namespace=pipeline_config.namespace,
        consumer=ConsumerSettings(max_deliver=3),
    )
    stage = ScriptStage()
    await running(stage, config)
    sub = await running.nc.subscribe(config.subjects.reply("flaky"))
    await publish(running.js, config, request("flaky", "x !retry"))
    [err] = await collect(sub, wait_s=20)
    assert isinstance(err, ErrorChunk) and err.retryable
    assert [c[0] for c in stage.calls].count("flaky") == 3
    [dead] = await dead_letters(running.js, config, 1)
    assert (dead.request_id, dead.deliveries) == ("flaky", 3)


async def test_cancel_stops_the_stage_mid_stream(running: Any, pipeline_config: PipelineConfig) -> None:
    stage = ScriptStage()
    await running(stage)
    subjects = pipeline_config.subjects
    sub = await running.nc.subscribe(subjects.reply("c1"))
    await publish(running.js, pipeline_config, request("c1", "!sleep=0.1 " + "w " * 100))
    await sub.next_msg(timeout=5)
    await running.nc.publish(subjects.cancel("c1"), b"")
    await asyncio.sleep(0.5)
    assert stage.running == 0 and "c1" not in stage.finished
    info = await running.js.stream_info(subjects.stream("processor"))
    assert info.state.messages == 0  # a cancelled request is done with, not retried


async def test_fetches_no_more_than_its_free_slots(running: Any, pipeline_config: PipelineConfig) -> None:
    stage = ScriptStage()
    await running(stage, max_inflight=2)
    subs = []
    for i in range(6):
        subs.append(await running.nc.subscribe(pipeline_config.subjects.reply(f"bp{i}")))
        await publish(running.js, pipeline_config, request(f"bp{i}", "!sleep=0.05 a b c"))
    for sub in subs:
        await collect(sub)
    assert stage.peak == 2


async def test_a_stage_without_room_holds_the_fetch_and_loses_nothing(
    running: Any, pipeline_config: PipelineConfig
) -> None:
    """A stage whose engine memory is spent says so (``has_room``): the
    worker fetches nothing more, the requests wait in the stream (not
    errors, not redeliveries), and all run once it has room again."""
    stage = ScriptStage()
    stage.room = False
    worker = await running(stage, max_inflight=4)
    subs = []
    for i in range(3):
        subs.append(await running.nc.subscribe(pipeline_config.subjects.reply(f"room{i}")))
        await publish(running.js, pipeline_config, request(f"room{i}", "a bb"))
    s = pipeline_config.subjects
    turned = worker.last_progress
    await eventually(lambda: worker.last_progress > turned + 0.5, within=5)  # the fetch loop turned, refraining
    consumer = await running.js.consumer_info(s.stream("processor"), s.durable("processor"))
    assert not stage.calls and consumer.num_pending == 3 and consumer.num_ack_pending == 0
    stage.room = True
    for i, sub in enumerate(subs):
        chunks = await collect(sub)
        assert [c.seq for c in chunks if isinstance(c, TokenChunk)] == [0, 1], f"room{i}"
    assert sorted(rid for rid, _ in stage.calls) == ["room0", "room1", "room2"]


async def test_expired_deadline_fails_without_work(running: Any, pipeline_config: PipelineConfig) -> None:
    stage = ScriptStage()
    await running(stage)
    sub = await running.nc.subscribe(pipeline_config.subjects.reply("late"))
    await publish(running.js, pipeline_config, request("late", "a b", deadline=time.time() - 1))
    [err] = await collect(sub)
    assert isinstance(err, ErrorChunk) and (err.code, err.http_status) == (ErrorCode.DEADLINE_EXCEEDED, 504)
    assert stage.calls == []


async def _crashed_first_delivery(js: Any, config: PipelineConfig, role: str) -> None:
    """What a worker that crashed mid-request leaves: its delivery given
    back unfinished (the worker died; nak stands in for the ack wait)."""
    psub = await js.pull_subscribe_bind(config.subjects.durable(role), config.subjects.stream(role))
    [msg] = await psub.fetch(1, timeout=5)
    await msg.nak(delay=0)
    await psub.unsubscribe()


async def test_takeover_resumes_after_what_was_emitted(running: Any, pipeline_config: PipelineConfig) -> None:
    subjects = pipeline_config.subjects
    await ensure_streams(running.js, pipeline_config)
    await ensure_consumer(running.js, pipeline_config, "processor")
    await publish(running.js, pipeline_config, request("tk", "a bb ccc dddd"))
    # The crashed worker's first delivery stored two of four tokens.
    for i in range(2):
        await running.js.publish(subjects.reply("tk"), encode(TokenChunk("tk", i, [i + 1], f"w{i} ")))
    await _crashed_first_delivery(running.js, pipeline_config, "processor")
    sub = await running.nc.subscribe(subjects.reply("tk"))
    stage = ScriptStage()
    await running(stage)
    chunks = await collect(sub)
    assert stage.calls == [("tk", [1, 2])]
    assert [c.seq for c in chunks] == [2, 3]


async def test_a_first_run_does_not_read_the_reply_stream(running: Any, pipeline_config: PipelineConfig) -> None:
    # Nothing a first delivery of a first attempt could find there: the round trip is skipped.
    subjects = pipeline_config.subjects
    await ensure_streams(running.js, pipeline_config)
    await running.js.publish(subjects.reply("fresh"), encode(TokenChunk("fresh", 0, [9], "x ")))
    stage = ScriptStage()
    await running(stage)
    sub = await running.nc.subscribe(subjects.reply("fresh"))
    await publish(running.js, pipeline_config, request("fresh", "a bb"))
    chunks = await collect(sub)
    assert stage.calls == [("fresh", [])]
    assert [c.seq for c in chunks] == [0, 1]


class ForwardStage(ScriptStage):
    """Hands every request on to decode."""

    async def run(
        self, message: GenerateRequest | ProcessedRequest, ctx: HopContext
    ) -> AsyncGenerator[StageOutput, None]:
        assert isinstance(message, GenerateRequest)
        self.calls.append((message.request_id, []))
        yield ProcessedRequest(message, [1], [], ["processor", "decode"], 4, 0, hop_index=1)


async def test_a_redelivered_hop_marks_what_it_forwards(running: Any, pipeline_config: PipelineConfig) -> None:
    # The decoding hop then reads what an earlier run of this request emitted.
    await ensure_streams(running.js, pipeline_config)
    await ensure_consumer(running.js, pipeline_config, "processor")
    await ensure_consumer(running.js, pipeline_config, "decode")
    await publish(running.js, pipeline_config, request("again", "a"))
    await _crashed_first_delivery(running.js, pipeline_config, "processor")
    await publish(running.js, pipeline_config, request("once", "a"))
    await running(ForwardStage())
    psub = await running.js.pull_subscribe_bind(
        pipeline_config.subjects.durable("decode"), pipeline_config.subjects.stream("decode")
    )
    forwarded = {}
    while len(forwarded) < 2:
        for msg in await psub.fetch(1, timeout=5):
            message = Decoder(ProcessedRequest).decode(msg.data)
            forwarded[message.request.request_id] = message.redelivered
    assert forwarded == {"again": True, "once": False}


async def test_drain_hands_unfinished_work_to_another_worker(running: Any, pipeline_config: PipelineConfig) -> None:
    first, second = ScriptStage(), ScriptStage()
    worker = await running(first, drain_grace_s=0.2)
    sub = await running.nc.subscribe(pipeline_config.subjects.reply("d1"))
    await publish(running.js, pipeline_config, request("d1", "!sleep=0.05 " + "w " * 40))
    await sub.next_msg(timeout=5)
    worker.stop()
    await running(second)
    chunks = await collect(sub, wait_s=20)
    assert chunks[-1].finish_reason == FinishReason.STOP  # type: ignore[union-attr]
    assert second.calls and second.calls[0][0] == "d1" and len(second.calls[0][1]) >= 1


class Forward:
    """A processor-like stage: each request goes on to one aggregated hop."""

    role = "processor"
    input_type = GenerateRequest
    resumes_stream = False
    models: ClassVar[list[str]] = ["script"]

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def has_room(self) -> bool:
        return True

    async def run(
        self, message: GenerateRequest | ProcessedRequest, ctx: HopContext
    ) -> AsyncGenerator[StageOutput, None]:
        assert isinstance(message, GenerateRequest)
        yield ProcessedRequest(message, [1], [], ["encode+prefill+decode"], max_tokens=1, seed=0)


async def test_a_full_next_hop_holds_the_message_until_there_is_room(running: Any, nats_server: Any) -> None:
    """Past full_stream_wait_s and well past ack_wait the message is held, not
    handed back (which would spend its deliveries): it goes on once the next
    hop's queue has room, delivered once."""
    config = PipelineConfig(
        nats_url=nats_server.url,
        namespace=f"bp{time.monotonic_ns()}",
        hop_limits=StreamLimits(max_msgs=1),
        consumer=ConsumerSettings(ack_wait_s=1.0),
        full_stream_wait_s=0.2,
    )
    await ensure_streams(running.js, config)
    hop = config.subjects.work("encode+prefill+decode")
    await running.js.publish(hop, b"someone else's work")  # the hop's queue is now full
    await running(Forward(), config=config)
    deadline = time.time() + 30
    await running.js.publish(config.subjects.requests, encode(request("held", "x", deadline=deadline)))
    processor = (config.subjects.stream("processor"), config.subjects.durable("processor"))
    await asyncio.sleep(2.5)  # over 10x full_stream_wait_s, over 2x ack_wait
    info = await running.js.consumer_info(*processor)
    assert (info.num_ack_pending, info.num_redelivered) == (1, 0)
    # Room: the hop's one message is taken.
    await running.js.delete_msg(config.subjects.stream("encode+prefill+decode"), 1)
    for _ in range(100):
        info = await running.js.consumer_info(*processor)
        if info.num_ack_pending == 0:
            break
        await asyncio.sleep(0.05)
    assert (info.num_ack_pending, info.num_redelivered, info.delivered.consumer_seq) == (0, 0, 1)
    hop_info = await running.js.stream_info(config.subjects.stream("encode+prefill+decode"))
    assert hop_info.state.messages == 1  # the held request, forwarded


async def test_without_a_deadline_a_full_next_hop_gives_the_message_back(running: Any, nats_server: Any) -> None:
    config = PipelineConfig(
        nats_url=nats_server.url,
        namespace=f"bp{time.monotonic_ns()}",
        hop_limits=StreamLimits(max_msgs=1),
        full_stream_wait_s=0.2,
    )
    await ensure_streams(running.js, config)
    await running.js.publish(config.subjects.work("encode+prefill+decode"), b"someone else's work")
    await running(Forward(), config=config)
    await running.js.publish(config.subjects.requests, encode(request("no-deadline", "x")))
    processor = (config.subjects.stream("processor"), config.subjects.durable("processor"))
    for _ in range(100):
        info = await running.js.consumer_info(*processor)
        if info.num_redelivered or info.delivered.consumer_seq > 1:
            break
        await asyncio.sleep(0.05)
    assert info.delivered.consumer_seq > 1 or info.num_redelivered > 0  # given back, tried again


async def _pending(js: Any, config: PipelineConfig, role: str, ack_pending: int) -> Any:
    """The role's consumer once ``ack_pending`` of its messages are out."""
    for _ in range(200):
        info = await js.consumer_info(config.subjects.stream(role), config.subjects.durable(role))
        if info.num_ack_pending == ack_pending:
            return info
        await asyncio.sleep(0.05)
    raise AssertionError(f"{role}: {info.num_ack_pending} messages out, not {ack_pending}")


def _one_second_ack_wait(nats_url: str) -> PipelineConfig:
    """A namespace of its own whose messages are redelivered 1 s after their last sign of life."""
    return PipelineConfig(
        nats_url=nats_url, namespace=f"na{time.monotonic_ns()}", consumer=ConsumerSettings(ack_wait_s=1.0)
    )


async def test_a_next_hop_no_stream_answers_for_holds_the_message_until_one_does(
    running: Any, nats_server: Any
) -> None:
    """No stream answers for the next hop (as while a cluster elects its
    leader after a node is lost): the message is held past ack_wait, not
    handed back, and forwarded once a stream answers. Handed back, a hop
    that had read its input tensors (read once) would find them gone on
    the redelivery and restart the request, spending an attempt."""
    config = _one_second_ack_wait(nats_server.url)
    await ensure_streams(running.js, config)
    stage = ForwardStage()
    await running(stage, config=config)  # provisions every stream
    await running.js.delete_stream(config.subjects.stream("decode"))
    await publish(running.js, config, request("held", "x", deadline=time.time() + 60))
    await _pending(running.js, config, "processor", 1)
    await asyncio.sleep(2.5)  # over 2x ack_wait
    info = await _pending(running.js, config, "processor", 1)
    assert (info.num_redelivered, info.delivered.consumer_seq) == (0, 1)
    await ensure_streams(running.js, config)  # a stream answers again
    info = await _pending(running.js, config, "processor", 0)
    assert (info.num_redelivered, info.delivered.consumer_seq) == (0, 1)
    assert [rid for rid, _ in stage.calls] == ["held"]
    hop = await running.js.stream_info(config.subjects.stream("decode"))
    assert hop.state.messages == 1


async def test_a_reply_no_stream_answers_for_is_held_until_one_does(running: Any, nats_server: Any) -> None:
    """The same for the reply stream: a decoding hop's chunks wait for it
    rather than its message being handed back (its KV cache read once)."""
    config = _one_second_ack_wait(nats_server.url)
    await ensure_streams(running.js, config)
    stage = ScriptStage()
    await running(stage, config=config)
    await running.js.delete_stream(config.subjects.reply_stream)
    await publish(running.js, config, request("replies", "a bb ccc", deadline=time.time() + 60))
    await _pending(running.js, config, "processor", 1)
    await asyncio.sleep(2.5)  # over 2x ack_wait
    info = await _pending(running.js, config, "processor", 1)
    assert (info.num_redelivered, info.delivered.consumer_seq) == (0, 1)
    sub = await running.nc.subscribe(config.subjects.reply("replies"))
    await ensure_streams(running.js, config)
    chunks = await collect(sub)
    assert [c.seq for c in chunks] == [0, 1, 2]  # type: ignore[union-attr]
    info = await _pending(running.js, config, "processor", 0)
    assert (info.num_redelivered, info.delivered.consumer_seq) == (0, 1)
    assert stage.calls == [("replies", [])]


async def test_jetstream_unanswering_past_unavailable_wait_s_gives_the_message_back(
    running: Any, nats_server: Any
) -> None:
    config = PipelineConfig(
        nats_url=nats_server.url,
        namespace=f"na{time.monotonic_ns()}",
        unavailable_wait_s=0.2,
    )
    await ensure_streams(running.js, config)
    stage = ForwardStage()
    await running(stage, config=config)
    await running.js.delete_stream(config.subjects.stream("decode"))
    await publish(running.js, config, request("given-back", "x", deadline=time.time() + 60))
    await eventually(lambda: len(stage.calls) > 1, within=10)  # given back, tried again


class LostInput(ScriptStage):
    """A decoding hop whose input tensors are gone every time."""

    role = "decode"
    input_type = ProcessedRequest  # type: ignore[assignment]

    async def run(
        self, message: GenerateRequest | ProcessedRequest, ctx: HopContext
    ) -> AsyncGenerator[StageOutput, None]:
        assert isinstance(message, ProcessedRequest)
        self.calls.append((message.request.request_id, []))
        raise TensorGone("the KV cache is gone")
        yield  # a generator, as a stage is


async def test_a_restart_no_stream_answers_for_is_given_back_and_queued_once_it_can(
    running: Any, nats_server: Any
) -> None:
    """A restart that cannot be queued is an outcome of the message (given
    back, tried again soon), not an error escaping its handler (the message
    then waited out ack_wait); the retried restart is the same attempt."""
    config = PipelineConfig(
        nats_url=nats_server.url,
        namespace=f"na{time.monotonic_ns()}",
        consumer=ConsumerSettings(ack_wait_s=60.0),
        unavailable_wait_s=0.2,
    )
    await ensure_streams(running.js, config)
    await ensure_consumer(running.js, config, "decode")
    stage = LostInput()
    await running(stage, config=config)
    await running.js.delete_stream(config.subjects.stream("encode"))
    lost = ProcessedRequest(request("lost", "x"), [1], [], ["encode", "decode"], 4, 0, hop_index=1)
    await running.js.publish(config.subjects.work("decode"), encode(lost))
    await eventually(lambda: len(stage.calls) > 1, within=10)
    await ensure_streams(running.js, config)  # the first hop's stream answers again
    encode_stream = config.subjects.stream("encode")
    for _ in range(200):
        if (await running.js.stream_info(encode_stream)).state.messages:
            break
        await asyncio.sleep(0.05)
    await _pending(running.js, config, "decode", 0)
    psub = await running.js.pull_subscribe(config.subjects.work("encode"), stream=encode_stream)
    msgs = await psub.fetch(10, timeout=2)
    assert [Decoder(ProcessedRequest).decode(m.data).attempt for m in msgs] == [1]


async def test_a_worker_that_freezes_its_heap_does_so_before_its_first_fetch(
    running: Any, pipeline_config: PipelineConfig
) -> None:
    """``mmpipe worker``'s startup heap (pipeline/gc_heap.py) is frozen before
    the worker fetches: the collection before the freeze holds the GIL, and
    a message fetched meanwhile waits for it."""
    import gc

    stage = ScriptStage()
    fetched_frozen: list[int] = []
    run = stage.run

    def observed(message: Any, ctx: HopContext) -> AsyncGenerator[StageOutput, None]:
        fetched_frozen.append(gc.get_freeze_count())
        return run(message, ctx)

    stage.run = observed  # type: ignore[method-assign]
    gc.unfreeze()
    try:
        await running(stage, freeze_heap=True)
        assert gc.get_freeze_count() > 0  # frozen by the time the worker says it has started
        sub = await running.nc.subscribe(pipeline_config.subjects.reply("f1"))
        await publish(running.js, pipeline_config, request("f1", "one two"))
        assert [c.token_ids for c in await collect(sub) if isinstance(c, TokenChunk)] == [[3], [3]]
        assert fetched_frozen and fetched_frozen[0] > 0
    finally:
        gc.unfreeze()  # the rest of the test session collects as before
