"""E/P/D on a 3-node NATS cluster with R3 streams and two workers per role,
each with its own connection to whichever node it picked: every request
equals generate(); one node is killed mid-run and restarted later, and no
accepted request is lost while the workers fail over by themselves."""

from __future__ import annotations

import asyncio
import collections
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from pipeline.config import ConsumerSettings, PipelineConfig
from schemas.routes import MODES, PROCESSOR
from stages.models import ModelSpec
from tests.cluster.nodes import running_cluster
from tests.e2e.conftest import ask, client, gradient, image_content, png_data_url, start_stack

N = 32


def _node_of(nc: Any) -> int | None:
    return nc.connected_url.port if nc.is_connected and nc.connected_url else None


async def _ask_until_accepted(c: openai.AsyncOpenAI, content: Any, refused: list[str]) -> str:
    """A request the bridge could not queue (503 no_workers while JetStream
    elects a leader) was never accepted: the client retries it, as one would."""
    for _ in range(60):
        try:
            text, usage = await ask(c, content, stream=True, n=N)
            assert usage == N
            return text
        except openai.APIStatusError as exc:
            if exc.status_code != 503:
                raise
            refused.append(str(exc))
            await asyncio.sleep(0.5)
    raise AssertionError("never accepted")


@pytest.mark.e2e
async def test_epd_split_survives_losing_a_nats_node(
    tmp_path: Path, model_spec: ModelSpec, reference: Any, namespace: str
) -> None:
    async with running_cluster(tmp_path) as cluster:
        config = PipelineConfig(
            nats_url=cluster.url,
            namespace=namespace,
            mode="e-p-d",
            replicas=3,
            # Short, so a message whose ack died with the node comes back soon.
            consumer=ConsumerSettings(ack_wait_s=5.0),
        )
        stack, stop = await start_stack(config, model_spec, counts={r: 2 for r in [PROCESSOR, *MODES["e-p-d"]]})
        try:
            images = [gradient(40 + 8 * i, 32 + 8 * (i % 3), i) for i in range(6)]
            contents: list[Any] = [
                image_content(png_data_url(im), f"What is picture {i}?") for i, im in enumerate(images)
            ]
            contents += ["Say something.", "Count to three."]
            expected = [reference(c, [images[i]] if i < len(images) else [], N)[1] for i, c in enumerate(contents)]
            refused: list[str] = []
            c = client(stack, timeout=120)

            # Warm: every request of the first round equals generate().
            assert await asyncio.gather(*(_ask_until_accepted(c, x, refused) for x in contents[:3])) == expected[:3]

            # The node to kill: one the bridge is not on (its own failover is the
            # client's retry), holding the most workers.
            per_node = collections.Counter(_node_of(w.nc) for w in stack.workers)
            bridge_node = _node_of(stack.nc)
            victim = max((n for n in cluster.nodes if n.port != bridge_node), key=lambda n: per_node[n.port])
            moved = [w for w in stack.workers if _node_of(w.nc) == victim.port]
            assert moved, f"no worker on a node other than the bridge's: {per_node}"

            running = [asyncio.create_task(_ask_until_accepted(c, x, refused)) for x in contents]
            await asyncio.sleep(0.3)  # mid-run: requests at every hop
            killed_at = time.monotonic()
            victim.kill()
            in_flight = sum(not t.done() for t in running)
            assert in_flight, "every request finished before the kill"
            # The workers that were on it reconnect to the other nodes by themselves.
            while not all(w.nc.is_connected and _node_of(w.nc) != victim.port for w in moved):
                assert time.monotonic() - killed_at < 30, "workers did not reconnect"
                await asyncio.sleep(0.05)
            reconnected_s = time.monotonic() - killed_at
            answers = await asyncio.gather(*running)
            served_s = time.monotonic() - killed_at
            assert answers == expected
            print(
                f"\nfailover: {len(moved)} workers reconnected in {reconnected_s:.2f}s; {in_flight} requests in"
                f" flight at the kill, all done {served_s:.2f}s after it; {len(refused)} refused at submit"
            )

            # The node comes back, catches up, and the cluster serves on.
            await asyncio.to_thread(victim.start)
            await asyncio.to_thread(cluster.wait_healthy)
            again = await asyncio.gather(*(_ask_until_accepted(c, x, refused) for x in contents[3:6]))
            assert again == expected[3:6]
            assert not [t for t in stack.tasks if t.done()], "a worker stopped"
            await c.close()
        finally:
            await stop()
