"""deploy/nats: the bare-host cluster config, started as three nodes on
loopback by deploy/nats/local-cluster.sh, forms a JetStream cluster that
holds an R3 stream and mmpipe's own streams; Ctrl-C stops every node."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import nats
import psutil
import pytest
from nats.js.api import StorageType, StreamConfig
from nats.js.errors import NoStreamResponseError

from pipeline.config import PipelineConfig
from pipeline.nats_server import find_binary
from pipeline.streams import ensure_consumer, ensure_streams

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "nats" / "local-cluster.sh"


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def nats_servers(pid: int) -> list[psutil.Process]:
    """The script's nats-server children (its own short-lived subshells come and go beside them)."""
    found = []
    for child in psutil.Process(pid).children():
        try:
            if child.name() == "nats-server":
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


def alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # gone between the two questions
        return False


def test_the_config_parses() -> None:
    env = {
        **os.environ,
        "NATS_NAME": "n1",
        "NATS_HOST": "127.0.0.1",
        "NATS_PORT": "4222",
        "NATS_CLUSTER_PORT": "6222",
        "NATS_HTTP_PORT": "8222",
        "NATS_STORE_DIR": "/tmp/unused",
    }
    env.update({f"NATS_ROUTE_{i}": f"nats-route://127.0.0.1:{6221 + i}" for i in (1, 2, 3)})
    checked = subprocess.run(
        [str(find_binary()), "-t", "-c", str(ROOT / "deploy" / "nats" / "cluster.conf")],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.e2e
async def test_local_cluster_holds_replicated_streams(tmp_path: Path) -> None:
    ports = free_ports(9)
    env = {
        **os.environ,
        "PORTS": " ".join(map(str, ports[0:3])),
        "CLUSTER_PORTS": " ".join(map(str, ports[3:6])),
        "HTTP_PORTS": " ".join(map(str, ports[6:9])),
        "DATA_DIR": str(tmp_path / "cluster"),
        "NATS_SERVER": str(find_binary()),
    }
    # As from a terminal, where Ctrl-C is not ignored: a suite started in the
    # background (nohup pytest &) runs with SIGINT ignored, the script would
    # inherit that, and a shell cannot trap a signal ignored when it started.
    as_from_a_terminal = (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp('bash', sys.argv[1:])"
    )
    script = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        as_from_a_terminal,
        "bash",
        str(SCRIPT),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert script.stdout is not None
    try:
        line = (await asyncio.wait_for(script.stdout.readline(), 60)).decode()
        assert line.startswith("nats cluster ready: "), line
        urls = line.split(": ", 1)[1].strip().split(",")
        assert urls == [f"nats://127.0.0.1:{p}" for p in ports[0:3]]
        servers = nats_servers(script.pid)
        assert len(servers) == 3

        nc = await nats.connect(servers=urls)
        try:
            js = nc.jetstream()
            # A replicated stream: a leader and two followers on the other nodes.
            info = await js.add_stream(
                StreamConfig(name="R3", subjects=["r3.>"], num_replicas=3, storage=StorageType.FILE)
            )
            assert info.cluster is not None and info.cluster.leader
            assert len(info.cluster.replicas or []) == 2
            # The stream's subject interest reaches this client's node a moment
            # after the stream exists (the leader may be another node).
            for _ in range(50):
                try:
                    ack = await js.publish("r3.x", b"kept on three nodes", timeout=1)
                    break
                except NoStreamResponseError:
                    await asyncio.sleep(0.1)
            else:
                pytest.fail("the R3 stream never answered a publish")
            assert ack.stream == "R3"
            # mmpipe provisions its streams and a consumer on the cluster as on one server.
            config = PipelineConfig(nats_url=",".join(urls), namespace="cluster")
            await ensure_streams(js, config)
            await ensure_consumer(js, config, "decode")
        finally:
            await nc.close()

        script.send_signal(signal.SIGINT)  # Ctrl-C
        assert await asyncio.wait_for(script.wait(), 30) == 0
        assert not [s.pid for s in servers if alive(s)]
    finally:
        if script.returncode is None:
            # The nodes run in sessions of their own: stop them by pid, not through the script.
            leftovers = nats_servers(script.pid)
            script.kill()
            await script.wait()
            for node in leftovers:
                node.kill()
