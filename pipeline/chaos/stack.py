"""The stack a chaos run disturbs: an embedded nats-server and every worker
and the bridge as their own OS processes (as ``mmpipe up`` starts them), each
a handle the run can SIGKILL, respawn or sample for memory."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from prometheus_client.parser import text_string_to_metric_families

from pipeline.nats_server import NatsServer, NatsServerConfig
from schemas.routes import MODES, PROCESSOR


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class StackOptions:
    mode: str = "e-p-d"
    # Workers of each role (the processor's too): two, so a killed one always has a survivor.
    per_role: int = 2
    model: str = "tiny-qwen2-vl"
    transport: str = "nixl"
    namespace: str = "chaos"
    # Short, so a killed worker's messages come back within seconds, not 30 s.
    ack_wait_s: float = 3.0
    # Small budgets, so "memory stays bounded" is a claim about numbers one can read.
    tensor_budget_mb: int = 32
    embedding_cache_bytes: int = 8 << 20
    decoded_cache_bytes: int = 8 << 20
    max_inflight: int = 8
    log_level: str = "WARNING"
    # Each worker's KV pool (--kv-cache-memory); small, so sequences wait for
    # blocks and are swapped out as they grow, with the longest sequence the
    # decoder takes (--decode-max-len) no more than it holds. None: the defaults.
    kv_cache_memory: str | None = None
    decode_max_len: int | None = None
    # --router kv: hops that prefill go to the worker holding their prefix (and back when it dies).
    router: str = "round-robin"


@dataclass
class Member:
    """One process of the stack."""

    role: str
    popen: subprocess.Popen[bytes]
    log: Path
    health_port: int = 0
    started: float = field(default_factory=time.monotonic)
    peak_rss: int = 0

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


class ChaosStack:
    def __init__(self, data_dir: Path, options: StackOptions | None = None) -> None:
        self.data_dir = data_dir
        self.options = options or StackOptions()
        self.nats = NatsServer(NatsServerConfig(data_dir=data_dir / "nats", port=free_port()))
        self.nats_url = ""
        self.members: list[Member] = []
        self.bridge: Member | None = None
        self.port = free_port()
        self.model_path = ""
        self.served_name = ""
        self._count = 0
        # The nats-server dies with the thread that started it (PR_SET_PDEATHSIG):
        # a restart runs on this thread, which lives as long as the stack.
        self.keeper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chaos-nats")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def roles(self) -> list[str]:
        return [PROCESSOR, *MODES[self.options.mode]]

    def _cli(self, *args: str, role: str, health_port: int = 0) -> Member:
        self._count += 1
        log = self.data_dir / f"{self._count:02d}-{role}.log"
        o = self.options
        common = ["--nats-url", self.nats_url, "--namespace", o.namespace, "--mode", o.mode]
        common += ["--log-level", o.log_level, "--ack-wait", str(o.ack_wait_s), "--router", o.router]
        with open(log, "wb") as out:
            popen = subprocess.Popen(
                [sys.executable, "-m", "pipeline.cli", *args, *common],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=os.environ.copy(),
            )
        return Member(role=role, popen=popen, log=log, health_port=health_port)

    def spawn(self, role: str) -> Member:
        o = self.options
        port = free_port()
        args = ["worker", role, "--model", self.model_path, "--served-model-name", self.served_name]
        args += ["--transport", o.transport, "--tensor-budget-mb", str(o.tensor_budget_mb)]
        args += ["--embedding-cache-bytes", str(o.embedding_cache_bytes), "--max-inflight", str(o.max_inflight)]
        args += ["--decoded-cache-bytes", str(o.decoded_cache_bytes)]
        if o.kv_cache_memory is not None:
            args += ["--kv-cache-memory", o.kv_cache_memory]
        if o.decode_max_len is not None:
            args += ["--decode-max-len", str(o.decode_max_len)]
        args += ["--health-port", str(port)]
        member = self._cli(*args, role=role, health_port=port)
        self.members.append(member)
        return member

    def start(self, timeout_s: float = 300.0) -> None:
        from stages.models import resolve_model

        self.data_dir.mkdir(parents=True, exist_ok=True)
        spec = resolve_model(self.options.model, None)
        self.model_path, self.served_name = str(spec.path), spec.served_name
        self.nats_url = self.keeper.submit(self.nats.start).result()
        for role in self.roles:
            for _ in range(self.options.per_role):
                self.spawn(role)
        self.bridge = self._cli("bridge", "--port", str(self.port), role="bridge")
        self.wait_ready(timeout_s)

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Every worker answers ready and the bridge sees every role."""
        deadline = time.monotonic() + timeout_s
        pending = [m for m in self.members if m.alive]
        while pending:
            for m in list(pending):
                if not m.alive:
                    raise RuntimeError(f"{m.role} exited with {m.popen.returncode}:\n{m.tail()}")
                if _http_ok(f"http://127.0.0.1:{m.health_port}/health/ready"):
                    pending.remove(m)
            if time.monotonic() > deadline:
                raise RuntimeError(f"not ready within {timeout_s}s: {[m.role for m in pending]}")
            time.sleep(0.2)
        while not _http_ok(f"{self.base_url}/health"):
            assert self.bridge is not None
            if not self.bridge.alive:
                raise RuntimeError(f"the bridge exited:\n{self.bridge.tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the bridge was not ready within {timeout_s}s")
            time.sleep(0.2)

    def holds(self, queue_msgs: int) -> int:
        """Requests the stack takes in before it must refuse one: every
        worker's in-flight window plus each role's work queue."""
        workers = sum(1 for m in self.members if m.alive)
        return workers * self.options.max_inflight + len(self.roles) * queue_msgs

    def workers(self, role: str) -> list[Member]:
        return [m for m in self.members if m.role == role and m.alive]

    def inflight(self, member: Member) -> float:
        """The worker's own count of requests in hand (its /metrics)."""
        return metric(member, "mmpipe_inflight")

    def kill(self, member: Member) -> None:
        member.popen.send_signal(signal.SIGKILL)
        member.popen.wait()

    def restart_nats(self, down_s: float = 1.0) -> Future[str]:
        """Stop the server (SIGTERM: it flushes its store) and start it again
        on the same port and store directory (on the keeper thread)."""

        def restart() -> str:
            self.nats.stop()
            time.sleep(down_s)
            return self.nats.start()

        return self.keeper.submit(restart)

    def rss(self) -> dict[str, int]:
        """The largest RSS (bytes) among the live processes of each role."""
        out: dict[str, int] = {}
        for m in [*self.members, *([self.bridge] if self.bridge else [])]:
            if not m.alive:
                continue
            try:
                rss = psutil.Process(m.popen.pid).memory_info().rss
            except psutil.Error:
                continue
            m.peak_rss = max(m.peak_rss, rss)
            out[m.role] = max(out.get(m.role, 0), rss)
        return out

    def budget_bytes(self, role: str) -> int:
        """What a worker of ``role`` may hold beyond its model: the tensor
        budget (NIXL registers it twice: held tensors and a receive arena)
        and, where it encodes, the embedding and decoded-media caches; where
        it decodes, copies of its KV pool's blocks swapped out to host memory
        (the pool itself is there from the start)."""
        if role == PROCESSOR or role == "bridge":
            return 0
        o = self.options
        cache = o.embedding_cache_bytes + o.decoded_cache_bytes if role.startswith("encode") else 0
        if "decode" in role and o.kv_cache_memory is not None:
            from stages.torch_engine.settings import parse_memory

            _, pool = parse_memory(o.kv_cache_memory)
            cache += pool or 0
        return 2 * (o.tensor_budget_mb << 20) + cache

    def stop(self) -> None:
        procs = [m for m in [*self.members, *([self.bridge] if self.bridge else [])] if m.alive]
        for m in procs:
            m.popen.send_signal(signal.SIGTERM)
        # Graceful (each drains), but a run's end need not wait out a drain grace.
        deadline = time.monotonic() + 10
        for m in procs:
            try:
                m.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                m.popen.kill()
                m.popen.wait()
        self.nats.stop()
        self.keeper.shutdown(wait=False)

    def __enter__(self) -> ChaosStack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def metric(member: Member, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of a metric's samples on a worker's /metrics (those with
    ``labels``, where given; 0 when unreachable)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{member.health_port}/metrics", timeout=2) as response:
            text = response.read().decode()
    except (urllib.error.URLError, OSError):
        return 0.0
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and (labels or {}).items() <= sample.labels.items()
    )
