"""``mmpipe up`` and ``mmpipe nats``: a whole deployment on one host, each
worker its own OS process, stopped together."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TextIO

import structlog

from pipeline.auth import NatsAuth
from pipeline.bridge.processing import BridgeProcessing
from pipeline.discovery import forget_nats_url, record_nats_url
from pipeline.kv_events import KvEventsSettings, offset_endpoint
from pipeline.nats_server import NatsServer, NatsServerConfig
from pipeline.serve import WorkerSettings, resolve_device
from pipeline.settings import BridgeProcess, UpProcess, WorkerProcess, handed_env
from pipeline.settings.kinds import NatsServerSettings, UpSettings
from schemas.errors import ModelNotFound
from schemas.routes import GENERATE_IMAGE, HOP_ROLES, MODES, PROCESSOR, ROLES, holds_kv
from stages.sglang_engine import SGLANG_ROLES
from stages.vllm_engine.args import VLLM_ROLES

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class RolePlan:
    """How many workers of a role ``mmpipe up`` starts, and on which devices
    (each worker on one, in turn; none listed: ``--device`` for all)."""

    count: int
    devices: tuple[str, ...] = ()

    def device_of(self, index: int) -> str | None:
        return self.devices[index % len(self.devices)] if self.devices else None


def parse_workers(spec: str, mode: str, image: bool = False) -> dict[str, RolePlan]:
    """``encode=1@cuda:0,prefill=1@cuda:1,decode=2@cuda:2,cuda:3`` over the
    mode's defaults of one each, no processor worker unless asked for (the
    bridge processes requests). After ``@`` the devices the role's workers
    take in turn; a bare device after them continues the list. ``image``:
    an image-generation stage too (one ``generate-image`` worker unless
    the spec says otherwise)."""
    plans = {PROCESSOR: RolePlan(0), **{role: RolePlan(1) for role in MODES[mode]}}
    if image:
        plans[GENERATE_IMAGE] = RolePlan(1)
    last = ""
    for item in filter(None, (s.strip() for s in spec.split(","))):
        if "=" not in item and last and plans[last].devices:
            plans[last] = RolePlan(plans[last].count, (*plans[last].devices, _device(item)))
            continue
        role, _, rest = item.partition("=")
        n, _, devices = rest.partition("@")
        if role not in plans:
            needs = f" ({GENERATE_IMAGE} needs --image-model)" if role == GENERATE_IMAGE else ""
            raise SystemExit(f"--workers: {role!r} is not a role of mode {mode}{needs}; its roles: {', '.join(plans)}")
        if not n.isdigit() or int(n) < 1:
            raise SystemExit(f"--workers: {item!r} needs a count of at least 1")
        if "@" in rest and not devices:
            raise SystemExit(f"--workers: {item!r} names no device after '@'")
        plans[role] = RolePlan(int(n), (_device(devices),) if devices else ())
        last = role
    return plans


def _check_image_model(name: str) -> None:
    """The image model found (and the built-in built) once here, not by the
    worker while `up` waits; a missing diffusers said plainly."""
    try:
        from stages.image_engine.checkpoint import image_model_path

        image_model_path(name)
    except ImportError as exc:
        raise SystemExit(f"mmpipe up --image-model: {exc.name} is missing: pip install 'mmpipe[image]'") from None
    except ModelNotFound as exc:
        raise SystemExit(f"mmpipe up: {exc.message}") from None


def _placed(role: str, plan: RolePlan) -> str:
    return f"{role}×{plan.count}" + (f"@{'|'.join(plan.devices)}" if plan.devices else "")


def _device(name: str) -> str:
    kind, _, index = name.partition(":")
    cards = index.split("+") if index else []
    if kind not in ("cpu", "cuda") or not all(c.isdigit() for c in cards) or (kind == "cpu" and index):
        raise SystemExit(f"--workers: {name!r} is not a device (cpu, cuda, cuda:N, or cuda:N+M+... for vLLM)")
    return name


def check_mode(engine: str, mode: str, vllm_encoder: bool = False) -> None:
    """``mmpipe up --engine vllm`` (or ``sglang``): every hop of the mode is
    an encode hop (built in) or one that engine runs."""
    if engine == "sglang":
        if vllm_encoder:
            raise SystemExit("mmpipe: --vllm-encoder needs --engine vllm")
        other = [hop for hop in MODES[mode] if hop != "encode" and hop not in SGLANG_ROLES]
        if other:
            raise SystemExit(
                f"mmpipe: --engine sglang serves the modes whose hops are encode or {' / '.join(SGLANG_ROLES)}; "
                f"{mode} has {', '.join(other)}"
            )
        return
    if engine != "vllm":
        if vllm_encoder:
            raise SystemExit("mmpipe: --vllm-encoder needs --engine vllm")
        return
    if vllm_encoder and "encode" not in MODES[mode]:
        # The encode worker is what runs vLLM encoder-only.
        raise SystemExit(
            f"mmpipe: --vllm-encoder (vLLM encoder-only on encode) needs an encode hop: e-pd or e-p-d, not {mode}"
        )
    other = [hop for hop in MODES[mode] if hop != "encode" and hop not in VLLM_ROLES]
    if other:
        raise SystemExit(
            f"mmpipe: --engine vllm serves the modes whose hops are encode or {' / '.join(VLLM_ROLES)} "
            f"(epd, e-pd, e-p-d, ep-d) so far; {mode} has {', '.join(other)}"
        )


class _Stop:
    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._set)

    def _set(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True


def _say(line: str, stream: TextIO | None = None) -> None:
    # One write: the children share this output, and print() under
    # PYTHONUNBUFFERED writes a line and its newline apart.
    out = stream or sys.stdout
    out.write(line + "\n")
    out.flush()


def run_nats(settings: NatsServerSettings) -> int:
    stop = _Stop()
    data_dir = Path(settings.data_dir).resolve() / "nats"
    config = NatsServerConfig(data_dir=data_dir, host=settings.host, port=settings.port, auth=NatsAuth.from_env())
    server = NatsServer(config)
    server.start()
    _say(f"nats-server ready: {server.url}")
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


def up(settings: UpProcess, external_nats: bool) -> int:
    from stages.models import resolve_model

    mode = settings.common.pipeline.mode
    check_mode(settings.worker.engine, mode, settings.up.vllm_encoder)
    if settings.up.vllm_encoder and settings.worker.media.frontend_decode:
        # vLLM encoder-only decodes its images itself, from the request's bytes.
        raise SystemExit("mmpipe: --frontend-decode is for the built-in encoder, not --vllm-encoder")
    data_dir = Path(settings.up.data_dir).resolve()
    worker = settings.worker
    if worker.engine == "vllm" and not worker.vllm_kv.path:
        # ExampleConnector keys its files by prompt tokens and image hashes,
        # not by model: what an earlier run (maybe of another checkpoint)
        # left in the default folder must not be loaded as this one's KV.
        shutil.rmtree(_kv_folder(data_dir), ignore_errors=True)
    stop = _Stop()
    # Resolved (and a built-in built) once here, not by every child at once.
    spec = resolve_model(worker.model, worker.served_model_name)
    if worker.image_model:
        _check_image_model(worker.image_model)
    # With an image model, the image-generation stage beside the model's roles.
    plans = parse_workers(settings.up.workers, mode, image=bool(worker.image_model))
    counts = {role: p.count for role, p in plans.items()}
    try:
        # The KV events endpoints, checked before anything starts (the last worker's port the highest).
        kv_events_of("decode", worker.kv_events, max(0, sum(n for r, n in counts.items() if holds_kv(r)) - 1))
    except ValueError as exc:
        raise SystemExit(f"mmpipe up: {exc}") from None
    server: NatsServer | None = None
    nats_url = settings.common.pipeline.nats_url
    if not external_nats:
        # The embedded server asks for the same user/password or token the
        # workers and the bridge present (from the environment they inherit).
        server = NatsServer(
            NatsServerConfig(data_dir=data_dir / "nats", port=settings.up.nats_port, auth=NatsAuth.from_env())
        )
        nats_url = server.start()
    spec_settings = dataclasses.replace(
        settings, worker=dataclasses.replace(worker, model=str(spec.path), served_model_name=spec.served_name)
    )
    children: list[subprocess.Popen[bytes]] = []
    bridge = settings.bridge
    try:
        # Where `mmpipe send` (run in the same folder, or given --data-dir) finds this deployment.
        record_nats_url(data_dir, nats_url)
        ports: list[str] = []
        for planned in plan(spec_settings, nats_url, plans, data_dir):
            if planned.health_port:
                ports.append(f"{planned.role} :{planned.health_port}")
                base = f"http://127.0.0.1:{planned.health_port}"
                log.info(
                    "worker_health_port", role=planned.role, ready=f"{base}/health/ready", metrics=f"{base}/metrics"
                )
            # A process group each: what a worker started (an engine core, its
            # media processes) is stopped with it (_stop_all), even where the
            # worker itself could not stop it (killed, or past its grace).
            children.append(
                subprocess.Popen(
                    [sys.executable, "-m", "pipeline.cli", *planned.argv], env=planned.env, process_group=0
                )
            )
        base = f"http://{bridge.host}:{bridge.port}"
        if not _wait_ready(f"{base}/health", children, stop, timeout_s=300):
            if stop.requested:
                return 0
            _say("mmpipe failed to start; see the log above", sys.stderr)
            return 1
        workers = ", ".join(_placed(role, p) for role, p in plans.items() if p.count)
        if not counts.get(PROCESSOR):
            workers += ", processor×1 for NATS callers (requests processed in the bridge)"
        # Each worker's /metrics and health, in start order (the processor's first: it runs no engine).
        metrics = f"  metrics: {', '.join(ports)}" if ports else ""
        _say(
            f"mmpipe ready: {base}/v1  mode={mode} model={spec.served_name} nats={nats_url} workers: {workers}{metrics}"
        )
        while not stop.requested:
            for child in children:
                if child.poll() is not None:
                    log.error("process_exited", args=" ".join(map(str, child.args)), code=child.returncode)  # type: ignore[arg-type]
                    return 1
            time.sleep(0.2)
        return 0
    finally:
        _stop_all(children, grace_s=worker.drain_grace_s + 10)
        forget_nats_url(data_dir, nats_url)
        if server is not None:
            server.stop()


@dataclass(frozen=True)
class Child:
    role: str
    # After `mmpipe`: the command alone; the settings ride in the environment.
    argv: list[str]
    env: dict[str, str]
    health_port: int = 0


def plan(settings: UpProcess, nats_url: str, plans: dict[str, RolePlan], data_dir: Path) -> list[Child]:
    """The processes ``mmpipe up`` starts, in order: every worker of
    ``plans`` (each with its role's settings, on its device) and the
    bridge, all on ``nats_url``."""
    pipeline = dataclasses.replace(settings.common.pipeline, nats_url=nats_url)
    common = dataclasses.replace(settings.common, pipeline=pipeline)
    env = dict(os.environ)
    out: list[Child] = []
    health_port = settings.worker.health.port
    kv_holders = 0
    workers: list[tuple[str, WorkerSettings, dict[str, str]]] = []
    for role in ROLES:
        role_plan = plans.get(role, RolePlan(0))
        if role == PROCESSOR and not role_plan.count:
            # The bridge processes the requests it takes over HTTP; one
            # processor worker takes those NATS callers queue (`mmpipe send`),
            # which would otherwise wait for ever.
            role_plan = RolePlan(1)
        for i in range(role_plan.count):
            worker = role_settings(role, settings.worker, settings.up, data_dir, health_port)
            worker = dataclasses.replace(worker, kv_events=kv_events_of(role, worker.kv_events, kv_holders))
            worker, placed = placed_on(worker, role_plan.device_of(i))
            kv_holders += holds_kv(role)
            workers.append((role, worker, placed))
            health_port += 1 if health_port else 0
    # Replicas of a role take requests from one queue at once; the roles of
    # a split pipeline work on a request one after another.
    engines = Counter(role for role, worker, _ in workers if role in HOP_ROLES and worker.engine == "torch")
    # Where no role has replicas, the devices are not resolved (no torch import here).
    replicas = (
        Counter(role for role, worker, _ in workers if on_cpu(role, worker))
        if max(engines.values(), default=0) > 1
        else Counter()
    )
    sharing = max(replicas.values(), default=0)
    for role, worker, placed in workers:
        if sharing > 1 and on_cpu(role, worker) and worker.torch_threads is None:
            worker = dataclasses.replace(worker, torch_threads=cores_each(sharing))
        handed = handed_env("worker", WorkerProcess(common, worker))
        out.append(Child(role, ["worker", role], {**env, **handed, **placed}, worker.health.port))
    counts = {role: p.count for role, p in plans.items()}
    bridge = BridgeProcess(common, settings.bridge, bridge_processing(settings.worker, counts))
    out.append(Child("bridge", ["bridge"], {**env, **handed_env("bridge", bridge)}))
    return out


def on_cpu(role: str, worker: WorkerSettings) -> bool:
    """Whether the worker runs the built-in engine on this host's CPU."""
    return role in HOP_ROLES and worker.engine == "torch" and resolve_device(worker.device) == "cpu"


def cores_each(workers: int) -> int:
    """The intra-op threads each built-in engine on this host's CPU gets
    (``--torch-threads`` unset) where a role has ``workers`` replicas: the
    cores shared out among them. Each worker's engine keeps one OpenMP
    team (stages/compute_threads.py); with a team of every core a worker,
    four workers on 2 vCPUs spun 8 threads on 2 cores (eight users' later
    turns 127 to 141 ms to their first token under the kv router, 82 to 88
    with the cores shared). The roles of a split pipeline are not counted
    together: one request's work goes through them in turn (E/P/D's first
    token at one client 1.8 to 2.8 ms after EPD's with a core each, within
    1 ms with both)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // workers)


def placed_on(worker: WorkerSettings, device: str | None) -> tuple[WorkerSettings, dict[str, str]]:
    """A worker on ``device`` (None: where ``--device`` says), and what its
    environment needs for it. The built-in engine takes ``cuda:N`` as it is
    (every card stays visible, so CUDA IPC reaches its peers' memory); vLLM
    takes the first card it sees, so it sees only its own."""
    if device is None:
        return worker, {}
    cards = device.partition(":")[2].split("+")
    if worker.engine == "vllm" and device.startswith("cuda"):
        args = dict(worker.vllm_args)
        if len(cards) > 1:
            # One worker over several cards: vLLM splits the model over them.
            args.setdefault("tensor_parallel_size", len(cards))
        visible = {"CUDA_VISIBLE_DEVICES": ",".join(cards) if cards != [""] else "0"}
        return dataclasses.replace(worker, device="cuda", vllm_args=args), visible
    if len(cards) > 1:
        raise SystemExit(f"--workers: {device}: the built-in engine runs a worker on one card (vLLM splits one)")
    return dataclasses.replace(worker, device=device), {}


def kv_events_of(role: str, events: KvEventsSettings, index: int) -> KvEventsSettings:
    """``mmpipe up``'s KV events endpoints for the ``index``-th worker that
    holds KV: the given ports offset by ``index``; none for the others."""
    if not events.endpoint or not holds_kv(role):
        return KvEventsSettings(topic=events.topic)
    replay = offset_endpoint(events.replay_endpoint, index) if events.replay_endpoint else ""
    return dataclasses.replace(events, endpoint=offset_endpoint(events.endpoint, index), replay_endpoint=replay)


def bridge_processing(worker: WorkerSettings, counts: dict[str, int]) -> BridgeProcessing:
    """The bridge processes requests for the workers' model, unless
    processor workers were asked for (``--workers processor=N``)."""
    if counts.get(PROCESSOR, 0):
        return BridgeProcessing(image_model=worker.image_model)
    return BridgeProcessing(
        image_model=worker.image_model,
        model=worker.model,
        served_model_name=worker.served_model_name,
        modalities=worker.modalities,
        limits=worker.limits,
        media=worker.media,
        transport=worker.transport,
        tensor_settings=worker.tensor_settings,
    )


def role_settings(
    role: str, worker: WorkerSettings, up: UpSettings, data_dir: Path, health_port: int
) -> WorkerSettings:
    """What a worker of ``role`` gets from ``mmpipe up``'s worker settings:
    vLLM only on the roles it runs (the encode role too with
    --vllm-encoder), one connector folder per deployment shared by its
    prefill and decode workers, a free NixlConnector port each, its own
    health port."""
    vllm = worker.engine == "vllm"
    # Unset, each worker still gets a port of its own: its /metrics and
    # health are there to read (logged as worker_health_port at start).
    health_port = health_port or _free_port(worker.health.host)
    engine = "vllm" if vllm and (role in VLLM_ROLES or (role == "encode" and up.vllm_encoder)) else "torch"
    if worker.engine == "sglang" and role in SGLANG_ROLES:
        engine = "sglang"
    kv = dataclasses.replace(worker.vllm_kv, port=0, path=worker.vllm_kv.path or str(_kv_folder(data_dir)))
    ec_path = (worker.vllm_ec_path or str(data_dir / "vllm-ec")) if vllm and up.vllm_encoder else ""
    return dataclasses.replace(
        worker,
        engine=engine,
        vllm_kv=kv,
        vllm_ec_path=ec_path if engine == "vllm" or role in VLLM_ROLES else "",
        health=dataclasses.replace(worker.health, port=health_port),
    )


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _kv_folder(data_dir: Path) -> Path:
    """The deployment's ExampleConnector folder when --vllm-kv-path names none."""
    return data_dir / "vllm-kv"


def _stop_all(children: list[subprocess.Popen[bytes]], grace_s: float = 40.0) -> None:
    """SIGTERM to each child (a worker drains, closes its engine and its
    media processes), SIGKILL past ``grace_s``; then whatever is left of a
    child's process group. A process a worker started outlives it when the
    worker is killed: vLLM's and SGLang's engine cores, a pool's media
    processes, each holding its memory (a GPU's too) until killed."""
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
    for child in children:
        _kill_group(child.pid)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nothing left in it
