"""KV events (pipeline/kv_events.py): what the built-in engine's prefix
cache does, published on a real ZMQ socket in vLLM's wire format and read
back with Structs written from vLLM's published types
(vllm.distributed.kv_events of vLLM 0.32: an array-like batch of tagged
map events, the optional fields of later versions left out): blocks cached with their keys,
parents and tokens, blocks taken for new content, the cache cleared; the
batches numbered, and the missed ones replayed on request."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from pipeline.kv_events import KvEventPublisher, KvEventsSettings, binds, offset_endpoint
from pipeline.launcher import kv_events_of
from schemas.kv_events import MEDIUM_CPU
from stages.torch_engine.engine import TorchEngine
from stages.torch_engine.kv_event_log import KvEventLog
from stages.torch_engine.settings import DecodeSettings
from tests.stages.engine_helpers import chat_prompt, decode, greedy

BLOCK = 16


# -- vLLM's types, as its publisher declares them ------------------------------------------------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _receive(sub: Any, n: int, within: float = 10.0) -> list[tuple[bytes, int, KVEventBatch]]:
    out = []
    deadline = time.monotonic() + within
    while len(out) < n:
        assert time.monotonic() < deadline, f"{len(out)} of {n} batches"
        if sub.poll(100):
            topic, seq, payload = sub.recv_multipart()
            out.append((topic, int.from_bytes(seq, "big"), DECODER.decode(payload)))
    return out


def _events(batches: list[tuple[bytes, int, KVEventBatch]]) -> list[Any]:
    return [e for _, _, batch in batches for e in batch.events]


@pytest.fixture
def engine(tiny_model_dir: Path) -> TorchEngine:
    probe = TorchEngine(tiny_model_dir, decode=DecodeSettings(slots=2, max_len=160))
    assert probe.decoder is not None
    memory = 11 * probe.decoder.bytes_per_block  # ten blocks: a second long prompt takes the first's
    e = TorchEngine(tiny_model_dir, decode=DecodeSettings(slots=2, max_len=160, kv_cache_memory=str(memory)))
    assert e.decoder is not None
    e.decoder.pool.log = KvEventLog(BLOCK, MEDIUM_CPU)
    return e


def _run(engine: TorchEngine, prompt: list[int]) -> int:
    [(seq, first)] = engine.prefill([prompt], [[]], [greedy(4)])
    decode(engine, seq, first, 4)
    engine.release(seq)
    return seq.cached_tokens


def test_the_prefix_caches_doings_reach_a_subscriber_as_vllms_events(engine: TorchEngine) -> None:
    assert engine.decoder is not None and engine.decoder.pool.log is not None
    port = _free_port()
    publisher = KvEventPublisher(engine.decoder.pool.log, f"tcp://*:{port}", topic="kv")
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        time.sleep(0.3)  # a SUB that joins late misses what came before (the replay is for that)
        a = chat_prompt(engine, [{"type": "text", "text": "alpha beta gamma delta " * 20}])
        b = chat_prompt(engine, [{"type": "text", "text": "one two three four five " * 16}])
        _run(engine, a)
        [(topic, seq, batch)] = _receive(sub, 1)
        assert (topic, seq, batch.data_parallel_rank) == (b"kv", 0, 0) and batch.ts > 0
        [stored] = batch.events
        assert isinstance(stored, BlockStored)
        full = len(a) // BLOCK
        assert len(stored.block_hashes) == full and stored.parent_block_hash is None
        assert stored.token_ids == a[: full * BLOCK] and stored.block_size == BLOCK
        assert (stored.lora_id, stored.medium, stored.lora_name) == (None, "CPU", None)
        # The pool's own keys: what a router then asks about.
        assert engine.decoder.pool.cached(list(map(int, stored.block_hashes))) != []
        # A second prompt needs the blocks the first left cached: some are forgotten.
        _run(engine, b)
        batches = _receive(sub, 1)
        while not any(isinstance(e, BlockStored) for e in _events(batches)):
            batches += _receive(sub, 1)  # the publisher may send what came before the store on its own
        events = _events(batches)
        removed = [e for e in events if isinstance(e, BlockRemoved)]
        assert removed and set(removed[0].block_hashes) <= set(stored.block_hashes)
        assert [type(e) for e in events] == [BlockRemoved, BlockStored]
        engine.reset_prefix_cache()
        [(_, seq, cleared)] = _receive(sub, 1)
        assert seq == 1 + len(batches) and [type(e) for e in cleared.events] == [AllBlocksCleared]
    finally:
        sub.close(linger=0)
        publisher.close()


def test_a_subscriber_that_missed_batches_gets_them_replayed_then_the_end_marker(engine: TorchEngine) -> None:
    assert engine.decoder is not None and engine.decoder.pool.log is not None
    port, replay_port = _free_port(), _free_port()
    publisher = KvEventPublisher(engine.decoder.pool.log, f"tcp://*:{port}", f"tcp://*:{replay_port}")
    ctx = zmq.Context.instance()
    req = ctx.socket(zmq.DEALER)
    req.connect(f"tcp://127.0.0.1:{replay_port}")
    try:
        # No subscriber at all: three batches go out unseen (each prompt's events
        # taken before the next prompt runs, so one batch each).
        for n, text in enumerate(("first prompt here ", "second prompt here ", "third prompt here "), start=1):
            _run(engine, chat_prompt(engine, [{"type": "text", "text": text * 12}]))
            deadline = time.monotonic() + 10
            while publisher.published < n:
                assert time.monotonic() < deadline, publisher.published
                time.sleep(0.01)
        req.send_multipart([b"", (1).to_bytes(8, "big")])
        got = []
        while True:
            assert req.poll(5000)
            _, seq, payload = req.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert payload == b""
                break
            got.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
        assert [s for s, _ in got] == [1, 2]
        assert all(isinstance(e, BlockStored) for _, batch in got for e in batch.events)
    finally:
        req.close(linger=0)
        publisher.close()


def test_endpoints_bind_or_connect_as_vllms_and_up_gives_each_kv_worker_its_own_port() -> None:
    assert binds("tcp://*:5557") and binds("ipc:///tmp/kv") and not binds("tcp://10.0.0.2:5557")
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559" and offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    given = KvEventsSettings(endpoint="tcp://*:5557", replay_endpoint="tcp://*:6557", topic="t")
    assert kv_events_of("prefill+decode", given, 1) == KvEventsSettings("tcp://*:5558", "tcp://*:6558", "t")
    assert kv_events_of("encode", given, 1).endpoint == ""
    assert kv_events_of("decode", KvEventsSettings(), 3) == KvEventsSettings()
    for wrong in ("udp://x:1", "tcp://x:port", "x:5557"):
        with pytest.raises(ValueError, match="tcp://HOST:PORT"):
            offset_endpoint(wrong, 0)


async def test_a_worker_that_holds_kv_publishes_and_names_its_endpoint_in_its_ping(
    nats_server: Any, tiny_model_dir: Path, namespace: str
) -> None:
    from pipeline.config import PipelineConfig
    from pipeline.connection import connect
    from pipeline.serve import WorkerSettings, build_stage
    from pipeline.worker import Worker
    from schemas.codec import Decoder
    from schemas.control import WorkerInfo

    endpoint = f"tcp://*:{_free_port()}"
    settings = WorkerSettings(model=str(tiny_model_dir), device="cpu", kv_events=KvEventsSettings(endpoint=endpoint))
    config = PipelineConfig(nats_url=nats_server.url, namespace=namespace)
    # Without a prefix cache there is nothing to tell.
    uncached = dataclasses.replace(settings, decode=DecodeSettings(prefix_caching=False))
    quiet = build_stage("encode+prefill+decode", config, uncached)
    assert getattr(quiet, "engine").kv_events_endpoint == ""  # noqa: B009
    await quiet.close()
    stage = build_stage("encode+prefill+decode", config, settings)
    nc, js = await connect(config.nats_url, "test-kv-events")
    worker = Worker(nc, js, config, stage)
    task = asyncio.create_task(worker.run())
    try:
        await asyncio.wait_for(worker.ready.wait(), 60)
        reply = await nc.request(config.subjects.ping("encode+prefill+decode"), b"", timeout=5)
        assert Decoder(WorkerInfo).decode(reply.data).kv_events_endpoint == endpoint
    finally:
        worker.stop()
        await task
        await nc.close()
