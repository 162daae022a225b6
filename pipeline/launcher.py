"""``mmpipe up`` and ``mmpipe nats``: a whole deployment on one host, each
worker its own OS process, stopped together."""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import FrameType

import structlog

from pipeline.auth import NatsAuth
from pipeline.bridge.app import BridgeSettings
from pipeline.config import PipelineConfig
from pipeline.engine_flags import check_mode, engine_flag_args, vllm_args, vllm_encoder_flag_args, vllm_kv_settings
from pipeline.limit_flags import media_flag_args, media_policy, processor_limit_args, processor_limits
from pipeline.nats_server import NatsServer, NatsServerConfig
from schemas.routes import MODES, PROCESSOR, ROLES

log = structlog.get_logger(__name__)


def parse_worker_counts(spec: str, mode: str) -> dict[str, int]:
    """``encode=2,prefill+decode=3`` over the mode's defaults of one each."""
    counts = {PROCESSOR: 1, **{role: 1 for role in MODES[mode]}}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        role, _, n = item.partition("=")
        if role not in counts:
            raise SystemExit(f"--workers: {role!r} is not a role of mode {mode}; its roles: {', '.join(counts)}")
        if not n.isdigit() or int(n) < 1:
            raise SystemExit(f"--workers: {item!r} needs a count of at least 1")
        counts[role] = int(n)
    return counts


class _Stop:
    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._set)

    def _set(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True


def run_nats(data_dir: Path, host: str, port: int) -> int:
    stop = _Stop()
    config = NatsServerConfig(data_dir=data_dir.resolve() / "nats", host=host, port=port, auth=NatsAuth.from_env())
    server = NatsServer(config)
    server.start()
    print(f"nats-server ready: {server.url}", flush=True)
    try:
        while not stop.requested and server.pid is not None:
            time.sleep(0.2)
    finally:
        server.stop()
    return 0


def _wait_ready(url: str, children: list[subprocess.Popen[bytes]], stop: _Stop, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not stop.requested:
        for child in children:
            if child.poll() is not None:
                log.error("process_exited_during_start", args=" ".join(map(str, child.args)), code=child.returncode)  # type: ignore[arg-type]
                return False
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    return False


def up(args: argparse.Namespace, config: PipelineConfig, bridge: BridgeSettings) -> int:
    from stages.models import resolve_model

    check_mode(args.engine, config.mode, args.vllm_encoder)
    # --vllm-encoder: one encoder-cache folder per deployment (vLLM encode writes, vLLM prefill reads).
    ec_path = (args.vllm_ec_path or str(args.data_dir.resolve() / "vllm-ec")) if args.vllm_encoder else ""
    engine_args = vllm_args(args)
    # One ExampleConnector folder per deployment, which its prefill and
    # decode workers share; NixlConnector ports are each worker's own.
    kv = vllm_kv_settings(args)
    kv = dataclasses.replace(kv, port=0, path=kv.path or str(args.data_dir.resolve() / "vllm-kv"))
    if not args.vllm_kv_path and args.engine == "vllm":
        # ExampleConnector keys its files by prompt tokens and image hashes,
        # not by model: what an earlier run (maybe of another checkpoint)
        # left in the default folder must not be loaded as this one's KV.
        shutil.rmtree(kv.path, ignore_errors=True)
    stop = _Stop()
    # Resolved (and a built-in built) once here, not by every child at once.
    spec = resolve_model(args.model, args.served_model_name)
    counts = parse_worker_counts(args.workers, config.mode)
    server: NatsServer | None = None
    nats_url = config.nats_url
    if not args.external_nats:
        data_dir: Path = args.data_dir.resolve()
        # The embedded server asks for the same user/password or token the
        # workers and the bridge present (from the environment they inherit).
        auth = NatsAuth.from_env()
        server = NatsServer(NatsServerConfig(data_dir=data_dir / "nats", port=args.nats_port, auth=auth))
        nats_url = server.start()
    common = ["--nats-url", nats_url, "--namespace", config.namespace, "--mode", config.mode]
    common += ["--log-level", args.log_level, "--ack-wait", str(config.consumer.ack_wait_s)]
    common += _stream_args(config)
    model_args = ["--model", str(spec.path), "--served-model-name", spec.served_name, "--device", args.device]
    model_args += ["--transport", args.transport, "--tensor-budget-mb", str(args.tensor_budget_mb)]
    model_args += ["--tensor-ttl", str(args.tensor_ttl)]
    if args.nixl_progress_thread:
        model_args += ["--nixl-progress-thread"]
    model_args += ["--modalities", args.modalities, "--embedding-cache-bytes", str(args.embedding_cache_bytes)]
    if args.allow_internal_media:
        model_args.append("--allow-internal-media")
    model_args += media_flag_args(media_policy(args)) + processor_limit_args(processor_limits(args))
    model_args += ["--max-batch", str(args.max_batch), "--decode-max-len", str(args.decode_max_len)]
    model_args += ["--prefill-batch", str(args.prefill_batch)]
    model_args += [] if args.batch_decode else ["--no-batch-decode"]
    model_args += [] if args.cuda_graphs else ["--no-cuda-graphs"]
    children: list[subprocess.Popen[bytes]] = []
    cli = [sys.executable, "-m", "pipeline.cli"]
    try:
        health_port = args.worker_health_port
        for role in ROLES:
            for _ in range(counts.get(role, 0)):
                health = ["--health-port", str(health_port)] if health_port else []
                if health_port:
                    log.info("worker_health_port", role=role, url=f"http://127.0.0.1:{health_port}/health/ready")
                    health_port += 1
                worker_args = [*common, *model_args, *health, *_consumer_args(config, args.drain_grace)]
                worker_args += engine_flag_args(role, args.engine, engine_args, kv, args.vllm_storage_ttl)
                worker_args += vllm_encoder_flag_args(role, args.engine, engine_args, ec_path, args.vllm_storage_ttl)
                children.append(subprocess.Popen([*cli, "worker", role, *worker_args]))
        bridge_args = ["--host", bridge.host, "--port", str(bridge.port)]
        bridge_args += ["--request-timeout", str(bridge.request_timeout_s)]
        if bridge.api_key:
            bridge_args += ["--api-key", bridge.api_key]
        children.append(subprocess.Popen([*cli, "bridge", *common, *bridge_args]))
        base = f"http://{bridge.host}:{bridge.port}"
        if not _wait_ready(f"{base}/health", children, stop, timeout_s=300):
            if stop.requested:
                return 0
            print("mmpipe failed to start; see the log above", file=sys.stderr, flush=True)
            return 1
        workers = ", ".join(f"{role}×{n}" for role, n in counts.items())
        print(
            f"mmpipe ready: {base}/v1  mode={config.mode} model={spec.served_name} nats={nats_url} workers: {workers}",
            flush=True,
        )
        while not stop.requested:
            for child in children:
                if child.poll() is not None:
                    log.error("process_exited", args=" ".join(map(str, child.args)), code=child.returncode)  # type: ignore[arg-type]
                    return 1
            time.sleep(0.2)
        return 0
    finally:
        _stop_all(children, grace_s=args.drain_grace + 10)
        if server is not None:
            server.stop()


def _stream_args(config: PipelineConfig) -> list[str]:
    out = ["--replicas", str(config.replicas)] if config.replicas is not None else []
    out += ["--queue-max-msgs", str(config.hop_limits.max_msgs), "--queue-max-bytes", str(config.hop_limits.max_bytes)]
    if config.placement and config.placement.cluster:
        out += ["--placement-cluster", config.placement.cluster]
    if config.placement and config.placement.tags:
        out += ["--placement-tags", ",".join(config.placement.tags)]
    return out


def _consumer_args(config: PipelineConfig, drain_grace_s: float) -> list[str]:
    c = config.consumer
    out = ["--max-deliver", str(c.max_deliver), "--max-ack-pending", str(c.max_ack_pending)]
    return [*out, "--drain-grace", str(drain_grace_s)]


def _stop_all(children: list[subprocess.Popen[bytes]], grace_s: float = 40.0) -> None:
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
