"""A 3-node nats-server cluster with JetStream on loopback, for benchmarks and
trials on one host (`mmpipe bench scale` measures R1 against R3 streams on
it). A cluster across hosts is deploy/nats/cluster.conf."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from pipeline.nats_server import find_binary

CLUSTER_NAME = "mmpipe-local"


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


class LocalCluster:
    def __init__(self, data_dir: Path, nodes: int = 3, max_payload: int = 8 * 1024 * 1024) -> None:
        self.data_dir = data_dir
        ports = _free_ports(3 * nodes)
        self.client_ports = ports[:nodes]
        cluster_ports, self.http_ports = ports[nodes : 2 * nodes], ports[2 * nodes :]
        routes = ", ".join(f"nats-route://127.0.0.1:{p}" for p in cluster_ports)
        self.configs = []
        for i in range(nodes):
            store = data_dir / f"n{i + 1}"
            store.mkdir(parents=True, exist_ok=True)
            conf = store / "nats.conf"
            conf.write_text(
                f"server_name: n{i + 1}\n"
                f"listen: 127.0.0.1:{self.client_ports[i]}\n"
                f"http: 127.0.0.1:{self.http_ports[i]}\n"
                f"max_payload: {max_payload}\n"
                f'jetstream {{ store_dir: "{store / "jetstream"}" }}\n'
                f"cluster {{ name: {CLUSTER_NAME}\n listen: 127.0.0.1:{cluster_ports[i]}\n routes: [{routes}] }}\n"
            )
            self.configs.append(conf)
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        """The client URLs, comma separated, as every mmpipe process takes them."""
        return ",".join(f"nats://127.0.0.1:{p}" for p in self.client_ports)

    def start(self, timeout_s: float = 60.0) -> None:
        for conf in self.configs:
            with open(conf.parent / "nats.log", "ab") as log:
                self.procs.append(
                    subprocess.Popen([str(find_binary()), "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT)
                )
        deadline = time.monotonic() + timeout_s
        while not all(self._healthy(p) for p in self.http_ports):
            if any(proc.poll() is not None for proc in self.procs):
                raise RuntimeError(f"a cluster node exited; see {self.data_dir}/n*/nats.log")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster was not healthy in {timeout_s:.0f}s; see {self.data_dir}/n*/nats.log")
            time.sleep(0.1)

    @staticmethod
    def _healthy(http_port: int) -> bool:
        # JetStream healthy, meta leader elected: streams can be created.
        try:
            url = f"http://127.0.0.1:{http_port}/healthz"
            with urllib.request.urlopen(url, timeout=1) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
