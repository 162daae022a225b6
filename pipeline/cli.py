"""The ``mmpipe`` command."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.metadata
import os
import sys
from pathlib import Path
from typing import Any

from pipeline import logging as mm_logging
from pipeline import stack_samples, tracing
from pipeline.auth import NatsAuth
from pipeline.bench.decode import add_arguments as add_decode_arguments
from pipeline.bench.encode import add_arguments as add_encode_arguments
from pipeline.bench.images import add_arguments as add_images_arguments
from pipeline.bench.kernels import add_arguments as add_kernels_arguments
from pipeline.bench.scale import add_arguments as add_scale_arguments
from pipeline.config import DEFAULT_NATS_URL, PipelineConfig
from pipeline.discovery import nats_url_beside_up
from pipeline.settings import (
    BridgeProcess,
    CommonSettings,
    Loaded,
    NatsProcess,
    SettingError,
    UpProcess,
    WorkerProcess,
    add_settings,
    load,
    load_kind,
)
from pipeline.streams import ProvisioningConflict
from schemas.routes import ROLES
from stages import compute_threads
from stages.models import DEFAULT_MODEL


def _run(coro: object) -> None:
    try:
        import uvloop

        uvloop.run(coro)  # type: ignore[arg-type]
    except ImportError:
        asyncio.run(coro)  # type: ignore[arg-type]


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="mmpipe", description="Multimodal LLM serving on NATS JetStream.")
    root.add_argument("--version", action="version", version=f"mmpipe {_version()}")
    sub = root.add_subparsers(dest="command", required=True)

    up = sub.add_parser(
        "up", help="a nats-server (embedded unless --nats-url) + every worker of a mode + the bridge", description=_UP
    )
    add_settings(up, UpProcess)

    worker = sub.add_parser("worker", help="run one worker of a role")
    worker.add_argument("role", choices=ROLES)
    add_settings(worker, WorkerProcess)

    bridge = sub.add_parser("bridge", help="run the OpenAI-compatible HTTP bridge")
    add_settings(bridge, BridgeProcess)

    nats = sub.add_parser("nats", help="run the embedded nats-server with JetStream")
    add_settings(nats, NatsProcess)

    send = sub.add_parser("send", help="publish one request over NATS and print the stream", formatter_class=_Shown)
    add_settings(send, CommonSettings)
    send.add_argument("--model", default=DEFAULT_MODEL, help="the served model name")
    send.add_argument("--image", action="append", default=[], help="image URL (data:, https://); repeatable")
    send.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most")
    send.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    send.add_argument("--json", action="store_true", help="send JSON instead of msgpack")
    _data_dir_flag(send, "without --nats-url")
    send.add_argument("--connect-timeout", type=float, default=5.0, help="seconds to wait for a NATS server to answer")
    send.add_argument("prompt")

    model = sub.add_parser("model", help="built-in models")
    msub = model.add_subparsers(dest="model_command", required=True)
    build = msub.add_parser(
        "build", help="build a built-in model, or a real-size preset, into a directory", formatter_class=_Shown
    )
    build.add_argument("name", nargs="?", help="a built-in model")
    build.add_argument("--preset", help="real-size shapes, random weights: qwen2-vl-2b, qwen2-vl-7b (bf16)")
    build.add_argument("--device", default="cuda", help="where a preset's weights are made (cuda: fast)")
    build.add_argument("--out", type=Path, required=True, help="the directory to write")
    path = msub.add_parser("path", help="print where a built-in model lives (built on first use)")
    path.add_argument("name")
    _bench(sub)
    from pipeline.chaos import add_parser as _chaos

    _chaos(sub)
    return root


_UP = """Starts every process of a deployment on this host: a nats-server (embedded
unless --nats-url names one), the processor and every worker of the mode as
OS processes (--workers adds more), and the bridge. Every worker and bridge
setting is taken here and handed to the processes that use it. Each setting
is also an MMPIPE_<FLAG> variable and a key of a --config TOML file; flags
beat variables beat the file beat defaults."""


class _Shown(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in the help of the hand-made flags (bench, send, model)."""


def _version() -> str:
    try:
        return importlib.metadata.version("mmpipe")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    # No abbreviations: a subcommand's own --mode must not be taken for this parser's --model or --modes.
    bench = sub.add_parser(
        "bench",
        help="load the bridge with the openai client; or `bench transport`",
        allow_abbrev=False,
        formatter_class=_Shown,
    )
    _load_flags(bench)
    bench.add_argument(
        "--breakdown",
        action="store_true",
        help="where the time to the first token goes, from the stack's traces (run it with --trace-nats)",
    )
    bench.add_argument(
        "--nats-url",
        default=os.environ.get("MMPIPE_NATS_URL"),
        help="with --breakdown: the stack's NATS, where its spans are published ($MMPIPE_NATS_URL; default: the "
        f"one the `mmpipe up` of --data-dir recorded, else {DEFAULT_NATS_URL})",
    )
    _data_dir_flag(bench, "with --breakdown and no --nats-url")
    bench.add_argument("--namespace", default="default", help="with --breakdown: the stack's namespace")
    bench.add_argument(
        "--compare-url",
        default="",
        metavar="URL",
        help="a second running stack's OpenAI base URL: every other request goes there, the rest to --url, and "
        "the report gives each side and the difference of each pair sent one after the other (two trees or two "
        "settings compared under one load, the host's drift shared)",
    )
    bench.add_argument(
        "--engine-metrics",
        action="append",
        default=[],
        metavar="URL",
        help="a worker's /metrics (mmpipe up: --health-port, one port a worker): where its engine thread's time "
        "went over the load (repeatable)",
    )
    bench.add_argument(
        "--workload",
        choices=("single", "multiturn"),
        default="single",
        help="single: independent requests; multiturn: --users conversations of --turns turns, each sent with "
        "the whole conversation once the answer before it is in (prefix caching's workload)",
    )
    bench.add_argument("--users", type=int, default=4, help="with --workload multiturn: conversations at once")
    bench.add_argument("--turns", type=int, default=3, help="with --workload multiturn: turns a conversation")
    bench.add_argument(
        "--conversations",
        type=int,
        default=1,
        help="with --workload multiturn: conversations each user holds one after another, each with its own image "
        "(more samples of each turn)",
    )
    bench.add_argument(
        "--router",
        default="",
        help="with --workload multiturn: start `mmpipe up --router R` for each (comma separated: kv,round-robin) and "
        "run the same conversations on each (the mode: the first of --modes; more flags: --up-arg)",
    )
    bench.add_argument(
        "--router-workers",
        default="",
        help="with --router: the stacks' --workers (e.g. encode+prefill+decode=4); a stack of one worker per role "
        "runs first, the hit rate to keep",
    )
    bench.add_argument("--compare-modes", action="store_true", help="start `mmpipe up` per mode, same load on each")
    bench.add_argument(
        "--compare-deployments",
        action="store_true",
        help="start `mmpipe up` per deployment on the same cards, same load on each: one EPD worker a card "
        "(replicas, the baseline), then splits of the roles over the cards (--deployment, or a default set)",
    )
    bench.add_argument(
        "--deployment",
        action="append",
        default=[],
        help="with --compare-deployments: NAME=MODE:WORKERS (WORKERS as `mmpipe up --workers` takes them), "
        "repeatable; in place of the default splits",
    )
    bench.add_argument(
        "--deploy-devices",
        default="",
        help="with --compare-deployments: the cards, comma separated (default: every CUDA device)",
    )
    bench.add_argument(
        "--probes",
        type=int,
        default=4,
        help="with --compare-deployments: greedy requests, one at a time, after each deployment's load, whose "
        "answers are compared with the replicas'",
    )
    bench.add_argument(
        "--compare-frontend-decode",
        action="store_true",
        help="with --compare-modes: each mode once as it is and once with --frontend-decode (the media decoded "
        "in the bridge); the table adds each process's CPU time per request",
    )
    bench.add_argument(
        "--modes", default="epd,e-pd,e-p-d,ep-d", help="with --compare-modes; with --router, its first is the mode"
    )
    bench.add_argument("--transport", choices=("auto", "nixl", "nats"), default="nixl", help="with --compare-modes")
    bench.add_argument(
        "--concurrencies", default="", help="with --compare-modes: comma-separated levels, each a run (e.g. 1,8,32)"
    )
    bench.add_argument(
        "--device", default="auto", help="with --compare-modes: the workers' (and the baseline's) device"
    )
    bench.add_argument(
        "--up-arg", action="append", default=[], help="with --compare-modes: a flag for `mmpipe up` (repeatable)"
    )
    bench.add_argument(
        "--hf-baseline",
        action="store_true",
        help="with --compare-modes: plain transformers generate() on the same requests, the ratios' baseline",
    )
    bsub = bench.add_subparsers(dest="bench_command")
    transport = bsub.add_parser(
        "transport", help="tensor transfer GB/s between two processes vs. memcpy", formatter_class=_Shown
    )
    transport.add_argument("--sizes", default="2MB,20MB", help="tensor sizes (KB/MB/GB decimal, KiB/MiB/GiB)")
    transport.add_argument("--repeats", type=int, default=20, help="measured transfers per size")
    transport.add_argument("--transports", default="nixl,nats")
    transport.add_argument("--nats-url", default=None, help="an existing nats-server (default: start one)")
    transport.add_argument("--json", action="store_true", help="print machine-readable results (JSON on stdout)")
    transport.add_argument("--log-level", default="ERROR", help="ERROR: the results alone")
    transport.add_argument(
        "--progress-thread", action="store_true", help="UCX's progress thread in both processes' NIXL agents"
    )
    transport.add_argument(
        "--device", default="cpu", help="cpu (DRAM) or cuda[:N] (VRAM of one GPU, against a device-to-device copy)"
    )
    transport.add_argument(
        "--reader-device",
        default=None,
        help="the reader's device if not --device's: cuda:1 reads cuda:0's VRAM (NVLink), against a copy_ across them",
    )
    decode = bsub.add_parser(
        "decode", help="batch decoder vs generate() and the HBM roofline (GPU)", formatter_class=_Shown
    )
    add_decode_arguments(decode)
    encode = bsub.add_parser(
        "encode", help="encoder images/s: one image per call vs --encode-batch (GPU)", formatter_class=_Shown
    )
    add_encode_arguments(encode)
    images = bsub.add_parser(
        "images",
        help="the image-generation stage against the diffusers pipeline alone: images/s at each batch",
        formatter_class=_Shown,
    )
    add_images_arguments(images)
    kernels = bsub.add_parser(
        "kernels",
        help="one request's encode and prefill on the GPU: kernels and time, compiled vs not",
        formatter_class=_Shown,
    )
    add_kernels_arguments(kernels)
    scale = bsub.add_parser(
        "scale", help="throughput with 1, 2, 4 workers of a role; R1 vs R3 streams on a cluster", formatter_class=_Shown
    )
    # The load's flags go before or after `scale` alike.
    _load_flags(scale, after=True)
    add_scale_arguments(scale)


def _data_dir_flag(p: argparse.ArgumentParser, when: str) -> None:
    """``--data-dir`` of a command run beside ``mmpipe up``: where to find the NATS URL it recorded."""
    p.add_argument(
        "--data-dir",
        default=os.environ.get("MMPIPE_DATA_DIR", ".mmpipe"),
        help=f"{when}: the NATS server the `mmpipe up` of this data dir recorded ($MMPIPE_DATA_DIR)",
    )


def _load_flags(p: argparse.ArgumentParser, after: bool = False) -> None:
    """The load `mmpipe bench` drives. ``after``: on a subcommand, where a
    flag left out keeps what was given before it (or the default)."""

    def add(flag: str, **kw: Any) -> None:
        if after:
            kw["default"] = argparse.SUPPRESS
        p.add_argument(flag, **kw)

    add("--url", default="http://127.0.0.1:8000/v1", help="the bridge's OpenAI base URL")
    add("--model", default=DEFAULT_MODEL, help="the served model name")
    add("--api-key", default=os.environ.get("MMPIPE_API_KEY"), help="the bridge's API key ($MMPIPE_API_KEY)")
    add("--concurrency", type=int, default=8, help="requests in flight at once")
    add("--requests", type=int, default=64, help="measured requests (after one warm-up)")
    add(
        "--requests-per-client",
        type=int,
        default=0,
        help="measured requests for each client, at every concurrency (instead of --requests): levels compared "
        "with the same number of rounds",
    )
    add("--max-tokens", type=int, default=32, help="tokens per request (min_tokens too)")
    add("--image-size", default="224x224", help="WIDTHxHEIGHT of the synthetic images")
    add("--images-per-request", type=int, default=1, help="images in each request")
    add("--seed", type=int, default=0, help="seed of the synthetic images")
    add(
        "--filler-words",
        type=int,
        default=0,
        help="words appended to each prompt (' the' each, one token for Qwen tokenizers): long-context loads",
    )
    add(
        "--processes",
        type=int,
        default=0,
        help="client processes sending the load (0: one per 16 streams, up to a quarter of the cores)",
    )
    add(
        "--trace-alternate",
        action="store_true",
        help="every other request asks to be traced (a sampled W3C traceparent), the rest not: TTFT of each "
        "apart, tracing's cost on one stack (run it with --trace-nats or --otlp-endpoint)",
    )
    add(
        "--client",
        choices=("openai", "aiohttp"),
        default="openai",
        help="what sends the load: the official openai client, or a bare aiohttp reader of the server-sent "
        "events (as vLLM's serving benchmark; on a small machine the openai client's own parsing is part of "
        "its TTFT)",
    )
    add("--json", action="store_true", help="print machine-readable results (JSON on stdout)")
    add("--log-level", default="ERROR", help="ERROR: the results alone")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return _main(args)
    except (SettingError, ProvisioningConflict) as exc:
        raise SystemExit(f"mmpipe: {exc}") from None


def _main(args: argparse.Namespace) -> int:
    if args.command in ("worker", "up"):
        # Before torch loads libgomp (mmpipe up's workers inherit it).
        compute_threads.brief_spin()
    if args.command == "worker":
        from pipeline.serve import run_worker

        worker: WorkerProcess = _started("worker", args).settings
        try:
            _run(run_worker(args.role, worker.common.pipeline, worker.worker))
        finally:
            tracing.shutdown()  # what is still batched goes out (OTLP; NATS is closed by now)
    elif args.command == "bridge":
        from pipeline.serve import run_bridge

        bridge: BridgeProcess = _started("bridge", args).settings
        try:
            _run(run_bridge(bridge.common.pipeline, bridge.bridge, bridge.processing))
        finally:
            tracing.shutdown()
    elif args.command == "nats":
        from pipeline.launcher import run_nats

        nats: NatsProcess = _started("nats", args).settings
        return run_nats(nats.server)
    elif args.command == "up":
        from pipeline.launcher import up

        loaded = _started("up", args)
        # A server named anywhere (flag, variable, file) is used; none: the embedded one.
        return up(loaded.settings, external_nats="common__pipeline__nats_url" in loaded.given)
    elif args.command == "send":
        from pipeline.send import send

        loaded_common = load(CommonSettings, "send", args)
        common: CommonSettings = loaded_common.settings
        _set_up(common.auth, common.log.level)
        given = common.pipeline.nats_url if "pipeline__nats_url" in loaded_common.given else None
        url, source = nats_url_beside_up(given, Path(args.data_dir), default=common.pipeline.nats_url)
        return _run_send(send, args, dataclasses.replace(common.pipeline, nats_url=url), source)
    elif args.command == "model":
        from stages.models import build_builtin, builtin_path

        mm_logging.configure("info")
        if args.model_command == "build" and args.preset:
            from stages.models.presets import build_preset

            print(build_preset(args.preset, args.out, args.device))
        elif args.model_command == "build":
            if not args.name:
                raise SystemExit("mmpipe model build: give a built-in model name or --preset")
            print(build_builtin(args.name, args.out))
        else:
            print(builtin_path(args.name))
    elif args.command == "bench":
        from pipeline.bench import main as bench

        mm_logging.configure(args.log_level)
        return bench(args)
    elif args.command == "chaos":
        from pipeline.chaos import main as chaos

        mm_logging.configure(args.log_level)
        return chaos(args)
    return 0


def _started(kind: str, args: argparse.Namespace) -> Loaded[Any]:
    loaded = load_kind(kind, args)
    tree = loaded.settings
    common = getattr(tree, "common", tree)
    _set_up(common.auth, common.log.level)
    if kind in ("worker", "bridge"):
        process = f"mmpipe-{getattr(args, 'role', kind)}"
        tracing.configure(common.tracing, process)
        stack_samples.start(common.tracing.stack_samples, process)
    return loaded


def _set_up(auth: NatsAuth, log_level: str) -> None:
    # The connection reads credentials from the environment, and every
    # process this one starts inherits them there.
    os.environ.update(auth.to_env())
    mm_logging.configure(log_level)


def _run_send(send: object, args: argparse.Namespace, config: PipelineConfig, source: str) -> int:
    result: list[int] = []

    async def go() -> None:
        result.append(await send(args, config, source))  # type: ignore[operator]

    _run(go())
    return result[0]


if __name__ == "__main__":
    sys.exit(main())
