"""The process kinds and the settings each takes.

``mmpipe worker ROLE`` (every role, the processor too), ``mmpipe bridge``,
``mmpipe up`` (all of a worker's and a bridge's settings, and its own) and
``mmpipe nats``. Each is one dataclass tree; its flags, variables, config
keys and the JSON ``mmpipe up`` hands its children all come from it.
"""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass
from typing import Any

from pipeline.auth import NatsAuth
from pipeline.bridge.app import BridgeSettings
from pipeline.bridge.processing import BridgeProcessing
from pipeline.config import PipelineConfig
from pipeline.serve import WorkerSettings
from pipeline.settings.leaves import leaves
from pipeline.settings.load import Loaded, load
from pipeline.tracing import TracingSettings
from schemas.settings import section, setting

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


@dataclass(frozen=True)
class LogSettings:
    level: str = setting("info", flag="log-level", choices=LOG_LEVELS, help="the least level logged (any case)")


@dataclass(frozen=True)
class CommonSettings:
    """What every process of a deployment shares (give them all the same)."""

    pipeline: PipelineConfig = section(PipelineConfig, "NATS and JetStream (give every process the same)")
    auth: NatsAuth = section(NatsAuth, "NATS credentials and TLS (variables keep them out of ps)")
    log: LogSettings = section(LogSettings, "logging")
    tracing: TracingSettings = section(TracingSettings, "traces (OpenTelemetry)")


@dataclass(frozen=True)
class WorkerProcess:
    common: CommonSettings = section(CommonSettings, "common")
    worker: WorkerSettings = section(WorkerSettings, "worker")


@dataclass(frozen=True)
class BridgeProcess:
    common: CommonSettings = section(CommonSettings, "common")
    bridge: BridgeSettings = section(BridgeSettings, "the OpenAI-compatible HTTP bridge")
    # mmpipe up fills it from the workers' model unless it starts processor workers.
    processing: BridgeProcessing = section(BridgeProcessing, "request processing in the bridge")


@dataclass(frozen=True)
class UpSettings:
    data_dir: str = setting(".mmpipe", help="the embedded nats-server's store (and vLLM's connector folders)")
    nats_port: int = setting(0, help="port of the embedded nats-server (0: any free one)")
    workers: str = setting(
        "",
        help="workers per role over the mode's one each, e.g. encode=2,prefill+decode=3; after @ the devices a "
        "role's workers take in turn, e.g. encode=1@cuda:0,prefill=1@cuda:1,decode=2@cuda:2,cuda:3 (unset: --device); "
        "cuda:N+M: one vLLM worker over both cards (tensor parallel)",
        metavar="ROLE=N[@DEVICE,...],...",
    )
    vllm_encoder: bool = setting(
        False,
        help="with --engine vllm and mode e-pd or e-p-d: the encode workers run vLLM encoder-only (images only) "
        "instead of mmpipe's built-in encoder",
    )


@dataclass(frozen=True)
class UpProcess:
    """``mmpipe up``: one host's whole deployment. Without --nats-url it
    starts an embedded nats-server; with it, it uses that server."""

    common: CommonSettings = section(CommonSettings, "common")
    up: UpSettings = section(UpSettings, "mmpipe up")
    worker: WorkerSettings = section(WorkerSettings, "worker")
    bridge: BridgeSettings = section(BridgeSettings, "the OpenAI-compatible HTTP bridge")


@dataclass(frozen=True)
class NatsServerSettings:
    data_dir: str = setting(".mmpipe", help="the server's JetStream store is <data-dir>/nats")
    host: str = setting("127.0.0.1", help="the address the server listens on")
    port: int = setting(4222, help="the client port")


@dataclass(frozen=True)
class NatsProcess:
    server: NatsServerSettings = section(NatsServerSettings, "the embedded nats-server")
    auth: NatsAuth = section(NatsAuth, "the clients' credentials (user/password or token)")
    log: LogSettings = section(LogSettings, "logging")


KINDS: dict[str, type] = {"worker": WorkerProcess, "bridge": BridgeProcess, "up": UpProcess, "nats": NatsProcess}


@functools.cache
def all_keys() -> frozenset[str]:
    return frozenset(leaf.key for kind in KINDS.values() for leaf in leaves(kind))


def load_kind(name: str, args: argparse.Namespace | None = None, environ: Any = None) -> Loaded[Any]:
    return load(KINDS[name], name, args, environ, known_keys=all_keys())
