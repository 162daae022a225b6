"""A 3-node nats-server cluster on loopback for tests, from deploy/nats/cluster.conf
(the bare-host config, unchanged), whose nodes a test can kill and restart."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from pipeline.nats_server import find_binary
from tests.deploy.test_nats_cluster import free_ports

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "deploy" / "nats" / "cluster.conf"


class Node:
    def __init__(self, name: str, port: int, cluster_port: int, http_port: int, env: dict[str, str], data: Path):
        self.name = name
        self.port = port
        self.http_port = http_port
        self.url = f"nats://127.0.0.1:{port}"
        self.env = {
            **env,
            "NATS_NAME": name,
            "NATS_HOST": "127.0.0.1",
            "NATS_PORT": str(port),
            "NATS_CLUSTER_PORT": str(cluster_port),
            "NATS_HTTP_PORT": str(http_port),
            "NATS_STORE_DIR": str(data / name),
        }
        self.log = data / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [str(find_binary()), "-c", str(CONF)],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/healthz", timeout=1) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def kill(self) -> None:
        """SIGKILL: the node is gone at once, as a crashed host is."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


class Cluster:
    def __init__(self, data: Path) -> None:
        ports = free_ports(9)
        routes = {f"NATS_ROUTE_{i + 1}": f"nats-route://127.0.0.1:{ports[3 + i]}" for i in range(3)}
        env = {**os.environ, **routes}
        self.nodes = [Node(f"n{i + 1}", ports[i], ports[3 + i], ports[6 + i], env, data) for i in range(3)]
        for node in self.nodes:
            (data / node.name).mkdir(parents=True, exist_ok=True)

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    @property
    def url(self) -> str:
        return ",".join(self.urls)

    def start(self, timeout_s: float = 60.0) -> None:
        for node in self.nodes:
            node.start()
        self.wait_healthy(timeout_s)

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(n.healthy() for n in self.nodes if n.running):
            for node in self.nodes:
                if node.proc is not None and node.proc.poll() is not None and node.proc.returncode not in (0, -9):
                    raise RuntimeError(f"{node.name} exited: {node.log.read_text(errors='replace')[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError("the cluster did not become healthy")
            time.sleep(0.1)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@contextlib.asynccontextmanager
async def running_cluster(data: Path) -> AsyncIterator[Cluster]:
    """A started cluster, stopped on the way out whatever happened (a test
    that fails while starting its stack leaves no nats-server behind)."""
    cluster = Cluster(data)
    try:
        await asyncio.to_thread(cluster.start)
        yield cluster
    finally:
        await asyncio.to_thread(cluster.stop)


async def interest_reached(listener: Client, senders: list[Client], within: float = 10.0) -> None:
    """Wait until every subscription ``listener`` has made so far is known to
    the nodes ``senders`` are on. A cluster tells its routes of a new
    subscription asynchronously, and a core publish from another node before
    then goes nowhere (the bridge backfills such a gap from the reply stream;
    a test reading a bare subscription cannot). A route carries a node's
    subscriptions in order, so once a probe made last is reachable, the
    earlier ones are too."""
    probe = f"_probe.{uuid.uuid4().hex}"

    async def answer(msg: Msg) -> None:
        await msg.respond(b"")

    sub = await listener.subscribe(probe, cb=answer)
    await listener.flush()
    deadline = time.monotonic() + within
    try:
        for sender in senders:
            while True:
                try:
                    await sender.request(probe, b"", timeout=0.5)
                    break
                except (NoRespondersError, NatsTimeoutError):
                    if time.monotonic() > deadline:
                        raise TimeoutError("a subscription did not reach every node in time") from None
                    await asyncio.sleep(0.02)
    finally:
        await sub.unsubscribe()
