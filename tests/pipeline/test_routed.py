"""A hop sent to one worker's own subject (--router kv) against a real
nats-server: started there when the worker has a slot; given back to the
shared queue when it does not start it in time, or when the worker stops;
and nothing of it is lost or run twice."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator
from typing import Any

from pipeline.config import PipelineConfig, RouterSettings
from pipeline.router.requeue import REQUEUED
from pipeline.worker import Worker
from schemas.chunk import FinishReason, TokenChunk
from schemas.codec import CONTENT_TYPE, MSGPACK, encode
from schemas.processed import ProcessedRequest
from stages.contract import HopContext, StageOutput
from tests.pipeline.test_worker import request, running  # noqa: F401  (a fixture)
from tests.polling import eventually, eventually_true

ROLE = "decode"


class HopStage:
    """A decode hop that streams one token per word; ``room`` False: it takes nothing."""

    role = ROLE
    input_type = ProcessedRequest
    resumes_stream = True

    def __init__(self) -> None:
        self.finished: list[str] = []
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

    async def run(self, message: ProcessedRequest | Any, ctx: HopContext) -> AsyncGenerator[StageOutput, None]:
        rid = message.request.request_id
        words = str(message.request.messages[0].content).split()
        for i in range(len(ctx.emitted), len(words)):
            last = i == len(words) - 1
            yield TokenChunk(rid, i, [len(words[i])], f"{words[i]} ", FinishReason.STOP if last else None)
        self.finished.append(rid)


def _hop(rid: str) -> ProcessedRequest:
    return ProcessedRequest(request(rid, "a bb ccc"), [1, 2, 3], [], [ROLE], 3, 0)


async def _send_to(js: Any, config: PipelineConfig, worker: Worker, rid: str) -> None:
    headers = {CONTENT_TYPE: MSGPACK, "Nats-Msg-Id": f"{rid}:0:0"}
    await js.publish(config.subjects.routed(ROLE, worker.worker_id), encode(_hop(rid)), headers=headers)


def _requeued(why: str) -> float:
    return REQUEUED.labels(ROLE, why)._value.get()


def _config(pipeline_config: PipelineConfig, wait_s: float = 2.0) -> PipelineConfig:
    return dataclasses.replace(pipeline_config, router=RouterSettings(mode="kv", routed_wait_s=wait_s))


async def test_a_hop_sent_to_a_worker_with_a_slot_runs_there(running: Any, pipeline_config: PipelineConfig) -> None:  # noqa: F811
    config = _config(pipeline_config)
    mine, other = HopStage(), HopStage()
    worker = await running(mine, config)
    await running(other, config)
    for i in range(4):
        await _send_to(running.js, config, worker, f"to-mine-{i}")
    await eventually(lambda: len(mine.finished) == 4, within=10)
    assert other.finished == []


async def test_a_hop_its_worker_does_not_start_in_time_goes_back_to_the_shared_queue(
    running: Any,  # noqa: F811
    pipeline_config: PipelineConfig,
) -> None:
    config = _config(pipeline_config, wait_s=0.3)
    busy, free = HopStage(), HopStage()
    busy.room = False  # its engine full: it starts nothing
    worker = await running(busy, config, max_inflight=2)
    await running(free, config)
    before = _requeued("waited")
    for i in range(3):
        await _send_to(running.js, config, worker, f"waited-{i}")
    await eventually(lambda: sorted(free.finished) == [f"waited-{i}" for i in range(3)], within=10)
    assert busy.finished == []
    # Two were held (its in-flight cap) and went back when their time ran out; the third waited in the stream.
    assert _requeued("waited") - before >= 2


async def test_a_stopping_worker_gives_back_what_waits_for_it_and_its_consumer_goes(
    running: Any,  # noqa: F811
    pipeline_config: PipelineConfig,
) -> None:
    config = _config(pipeline_config, wait_s=60)
    busy, other = HopStage(), HopStage()
    busy.room = False
    worker = await running(busy, config, max_inflight=1)
    await running(other, config)
    for i in range(3):
        await _send_to(running.js, config, worker, f"drained-{i}")
    await asyncio.sleep(0.5)  # one held, two queued on its subject: none started
    assert other.finished == []
    before = _requeued("drained")
    worker.stop()
    await eventually(lambda: sorted(other.finished) == [f"drained-{i}" for i in range(3)], within=10)
    assert _requeued("drained") - before == 3
    assert busy.finished == []

    async def consumer_gone() -> bool:
        names = [c.name for c in await running.js.consumers_info(config.subjects.stream(ROLE))]
        return config.subjects.routed_durable(ROLE, worker.worker_id) not in names

    await eventually_true(consumer_gone, within=10, what="the stopped worker's consumer is deleted")
