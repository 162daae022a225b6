"""Stream and consumer provisioning converges: many processes at once, an
updatable difference updated, one JetStream cannot update reported clearly;
replicas, placement and per-role consumer settings from the CLI."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, RetentionPolicy, StorageType, StreamConfig

from pipeline.cli import parser
from pipeline.config import ConsumerSettings, PipelineConfig, Placement, StreamLimits
from pipeline.connection import connect
from pipeline.nats_server import NatsServer
from pipeline.settings import load_kind
from pipeline.streams import ProvisioningConflict, ensure_consumer, ensure_streams, stream_configs
from pipeline.worker import Worker
from schemas.chunk import FinishReason, TokenChunk
from tests.cluster.nodes import interest_reached, running_cluster
from tests.pipeline.test_worker import ScriptStage, collect, publish, request


def _settings(*argv: str) -> Any:
    args = parser().parse_args(argv)
    return load_kind(args.command, args).settings


def _config(*argv: str) -> PipelineConfig:
    config: PipelineConfig = _settings(*argv).common.pipeline
    return config


def test_cli_flags_reach_the_config() -> None:
    settings = _settings(
        "worker", "decode", "--nats-url", "nats://a:4222,nats://b:4222", "--replicas", "3",
        "--placement-cluster", "east", "--placement-tags", "ssd, gpu", "--ack-wait", "12",
        "--max-deliver", "7", "--max-ack-pending", "64", "--drain-grace", "9",
    )  # fmt: skip
    config = settings.common.pipeline
    assert config.replicas == 3
    assert config.placement == Placement(cluster="east", tags=("ssd", "gpu"))
    assert config.consumer_for("decode") == ConsumerSettings(ack_wait_s=12.0, max_deliver=7, max_ack_pending=64)
    assert settings.worker.drain_grace_s == 9.0
    streams = stream_configs(config)
    assert {s.num_replicas for s in streams} == {3}
    assert all(s.placement is not None and s.placement.tags == ["ssd", "gpu"] for s in streams)
    # Without the flags a process leaves an existing stream's replicas and placement alone.
    plain = _config("bridge")
    assert plain.replicas is None and not plain.placement
    assert {s.placement for s in stream_configs(plain)} == {None}
    assert {s.num_replicas for s in stream_configs(plain)} == {None}


async def test_many_processes_provision_at_once(nats_server: NatsServer, namespace: str) -> None:
    decode = ConsumerSettings(ack_wait_s=4.0, max_deliver=3, max_ack_pending=16)
    config = PipelineConfig(nats_url=nats_server.url, namespace=namespace, role_consumers={"decode": decode})
    conns = [await connect(config.nats_url, f"starter-{i}") for i in range(4)]
    try:

        async def start(js: Any) -> None:
            await ensure_streams(js, config)
            await ensure_consumer(js, config, "decode")
            await ensure_consumer(js, config, "prefill")

        await asyncio.gather(*(start(js) for _, js in conns))
        js = conns[0][1]
        names = {s.config.name for s in await js.streams_info()}
        assert names == {s.name for s in stream_configs(config)}
        info = await js.consumer_info(config.subjects.stream("decode"), config.subjects.durable("decode"))
        assert (info.config.ack_wait, info.config.max_deliver, info.config.max_ack_pending) == (4.0, 3, 16)
        # Roles without their own settings get the default ones.
        info = await js.consumer_info(config.subjects.stream("prefill"), config.subjects.durable("prefill"))
        assert info.config.ack_wait == ConsumerSettings().ack_wait_s
    finally:
        for nc, _ in conns:
            await nc.close()


async def test_a_changed_stream_is_updated_or_reported(nats_server: NatsServer, namespace: str) -> None:
    config = PipelineConfig(nats_url=nats_server.url, namespace=namespace)
    s = config.subjects
    nc, js = await connect(config.nats_url, "test")
    try:
        await ensure_streams(js, config)
        # An updatable difference (a limit) converges on what the process asks for.
        await ensure_streams(js, dataclasses.replace(config, hop_limits=StreamLimits(max_msgs=50)))
        assert (await js.stream_info(s.stream("decode"))).config.max_msgs == 50
        # One JetStream cannot change in place is named, not retried or ignored.
        with pytest.raises(ProvisioningConflict, match=r"replicas > 1 not supported"):
            await ensure_streams(js, dataclasses.replace(config, replicas=3))
        await js.delete_stream(s.stream("decode"))
        await js.add_stream(
            StreamConfig(name=s.stream("decode"), subjects=[s.work("decode")], storage=StorageType.MEMORY)
        )
        with pytest.raises(ProvisioningConflict, match=r"MMPIPE_\w+_DECODE.*retention.*storage"):
            await ensure_streams(js, config)
        # A durable JetStream cannot turn into mmpipe's (a push consumer) is reported too.
        await js.add_consumer(
            s.stream("prefill"),
            ConsumerConfig(
                durable_name=s.durable("prefill"),
                filter_subject=s.work("prefill"),
                ack_policy=AckPolicy.EXPLICIT,
                deliver_policy=DeliverPolicy.ALL,
                deliver_subject="elsewhere",
            ),
        )
        with pytest.raises(ProvisioningConflict, match=r"consumer mmpipe-prefill: JetStream refused.*push consumer"):
            await ensure_consumer(js, config, "prefill")
        assert (await js.stream_info(s.stream("decode"))).config.retention == RetentionPolicy.LIMITS
    finally:
        await nc.close()


@pytest.mark.e2e
async def test_two_workers_of_a_role_start_at_once_on_a_cluster(tmp_path: Path, namespace: str) -> None:
    async with running_cluster(tmp_path) as cluster:
        config = PipelineConfig(
            nats_url=cluster.url, namespace=namespace, replicas=3, consumer=ConsumerSettings(ack_wait_s=6.0)
        )
        conns = [await connect(url, f"worker-{i}") for i, url in enumerate(cluster.urls[:2])]
        stages = [ScriptStage(), ScriptStage()]
        workers = [Worker(nc, js, config, stage, max_inflight=2) for (nc, js), stage in zip(conns, stages, strict=True)]
        tasks = [asyncio.create_task(w.run()) for w in workers]
        client, js = await connect(cluster.urls[2], "client")
        try:
            ready = asyncio.gather(*(w.ready.wait() for w in workers))
            await asyncio.wait([asyncio.ensure_future(ready), *tasks], timeout=60, return_when="FIRST_COMPLETED")
            for task in tasks:
                if task.done():
                    task.result()  # what stopped a worker
            assert all(w.ready.is_set() for w in workers)
            for cfg in stream_configs(config):
                info = await js.stream_info(cfg.name)
                assert info.config.num_replicas == 3
                assert info.cluster is not None and len(info.cluster.replicas or []) == 2
            s = config.subjects
            consumer = await js.consumer_info(s.stream("processor"), s.durable("processor"))
            assert consumer.config.ack_wait == 6.0
            assert consumer.cluster is not None and len(consumer.cluster.replicas or []) == 2
            # Both serve the role's one queue (six requests, two at a time each).
            subs = {rid: await client.subscribe(s.reply(rid)) for rid in (f"c{i}" for i in range(6))}
            await interest_reached(client, [nc for nc, _ in conns])
            for rid in subs:
                await publish(js, config, request(rid, "!sleep=0.2 a bb ccc"))
            for sub in subs.values():
                chunks = await collect(sub, wait_s=30)
                tokens = [c for c in chunks if isinstance(c, TokenChunk)]
                # A publish whose ack timed out (a cluster still electing) is
                # sent again: the stream drops the copy, a plain subscriber
                # sees it, and a reader skips a seq it has (pipeline/replies.py).
                first = {c.seq: c for c in reversed(tokens)}
                assert all(c == first[c.seq] for c in tokens)
                assert sorted(first) == [0, 1, 2] and [c.seq for c in tokens if c is first[c.seq]] == [0, 1, 2]
                assert isinstance(chunks[-1], TokenChunk) and chunks[-1].finish_reason == FinishReason.STOP
            assert all(stage.calls for stage in stages)
        finally:
            for w in workers:
                w.stop()
            await asyncio.wait(tasks, timeout=20)
            for nc, _ in conns:
                await nc.close()
            await client.close()


def test_replicas_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # deploy/k8s sets MMPIPE_REPLICAS for every pod from its ConfigMap.
    monkeypatch.setenv("MMPIPE_REPLICAS", "3")
    assert _config("bridge").replicas == 3
    assert _config("worker", "decode", "--replicas", "1").replicas == 1
