"""The ``mmpipe`` command."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from pipeline import logging as mm_logging
from pipeline.auth import ENV, NatsAuth
from pipeline.bench.decode import add_arguments as add_decode_arguments
from pipeline.bench.encode import add_arguments as add_encode_arguments
from pipeline.bench.scale import add_arguments as add_scale_arguments
from pipeline.bridge.app import BridgeSettings
from pipeline.config import ConsumerSettings, PipelineConfig, Placement, StreamLimits
from pipeline.engine_flags import add_engine_flags, vllm_args, vllm_kv_settings
from pipeline.health import HealthSettings
from pipeline.limit_flags import add_media_flags, add_processor_flags, media_policy, processor_limits
from pipeline.streams import ProvisioningConflict
from schemas.routes import MODES, ROLES
from stages.torch_engine.settings import DecodeSettings

DEFAULT_MODEL = "tiny-qwen2-vl"


def _run(coro: object) -> None:
    try:
        import uvloop

        uvloop.run(coro)  # type: ignore[arg-type]
    except ImportError:
        asyncio.run(coro)  # type: ignore[arg-type]


_AUTH_FLAGS = {
    "--nats-user": "user",
    "--nats-password": "password",
    "--nats-token": "token",
    "--nats-creds": "creds_file",
    "--nats-nkey": "nkey_seed_file",
    "--nats-tls-ca": "tls_ca",
    "--nats-tls-cert": "tls_cert",
    "--nats-tls-key": "tls_key",
    "--nats-tls-hostname": "tls_hostname",
}


def _auth(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group(
        "NATS credentials and TLS (or the MMPIPE_NATS_* environment, which keeps them out of ps)"
    )
    for flag, name in _AUTH_FLAGS.items():
        group.add_argument(flag, dest=f"auth_{name}", default=None, help=f"default: ${ENV[name]}")


def _apply_auth(args: argparse.Namespace) -> None:
    # Flags become the environment: this process reads it, and every process
    # it starts inherits it.
    for name in _AUTH_FLAGS.values():
        value = getattr(args, f"auth_{name}", None)
        if value:
            os.environ[ENV[name]] = value
    NatsAuth.from_env()  # a half-given pair fails here, at start


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--nats-url",
        default=os.environ.get("MMPIPE_NATS_URL", "nats://127.0.0.1:4222"),
        help="a NATS server URL, or a cluster's URLs comma separated (reconnects across them)",
    )
    p.add_argument("--namespace", default=os.environ.get("MMPIPE_NAMESPACE", "default"))
    p.add_argument("--mode", choices=sorted(MODES), default="epd")
    p.add_argument("--log-level", default="INFO")
    p.add_argument(
        "--ack-wait",
        type=float,
        default=float(os.environ.get("MMPIPE_ACK_WAIT", ConsumerSettings.ack_wait_s)),
        help="seconds before a message a dead worker held goes to another worker (heartbeats every third of it)",
    )
    _auth(p)
    _streams(p)


def _streams(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("JetStream streams (give every process of a deployment the same)")
    replicas = os.environ.get("MMPIPE_REPLICAS")
    group.add_argument(
        "--replicas",
        type=int,
        default=int(replicas) if replicas else None,
        help="copies of each stream, 3 on a 3-node cluster (default $MMPIPE_REPLICAS; unset: 1 for a new "
        "stream, an existing one keeps its own)",
    )
    group.add_argument(
        "--placement-cluster",
        default=os.environ.get("MMPIPE_PLACEMENT_CLUSTER"),
        help="the NATS cluster (by name) to place the streams in",
    )
    group.add_argument(
        "--placement-tags",
        default=os.environ.get("MMPIPE_PLACEMENT_TAGS"),
        help="place the streams on servers with all these server_tags, comma separated",
    )
    limits = StreamLimits()
    group.add_argument(
        "--queue-max-msgs",
        type=int,
        default=limits.max_msgs,
        help="messages a work queue holds (a full request queue is the bridge's 429; a full inner one holds "
        "the upstream worker)",
    )
    group.add_argument("--queue-max-bytes", type=int, default=limits.max_bytes, help="bytes a work queue holds")


def _consumer(p: argparse.ArgumentParser, whom: str) -> None:
    """With --ack-wait (in _common): the settings of the durable consumer."""
    group = p.add_argument_group(f"the durable consumer of {whom} (every worker of a role should agree) and drain")
    d = ConsumerSettings()
    group.add_argument(
        "--max-deliver", type=int, default=d.max_deliver, help="deliveries of a message before it is dead-lettered"
    )
    group.add_argument(
        "--max-ack-pending",
        type=int,
        default=d.max_ack_pending,
        help="messages out at once over all workers of the role",
    )
    group.add_argument(
        "--drain-grace",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds to finish in-flight work before handing the rest to other workers",
    )


def _model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="a built-in model name or a local checkpoint directory")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--allow-internal-media", action="store_true", help="allow http:// and internal media URLs")
    p.add_argument(
        "--modalities",
        default=os.environ.get("MMPIPE_MODALITIES", "image"),
        help="media kinds the processor accepts, e.g. image,video,audio (others get 422)",
    )
    p.add_argument(
        "--transport",
        choices=("auto", "nixl", "nats"),
        default=os.environ.get("MMPIPE_TRANSPORT", "auto"),
        help="how tensors move between hops: NIXL, the NATS object store, or auto (NIXL if it imports)",
    )
    p.add_argument(
        "--tensor-budget-mb", type=int, default=256, help="MiB of tensors a worker holds for readers at most"
    )
    p.add_argument("--tensor-ttl", type=float, default=60.0, help="seconds before unread tensors are freed")
    p.add_argument(
        "--nixl-progress-thread",
        action="store_true",
        help="UCX's progress thread in the NIXL agent: READs of this worker's tensors complete at once "
        "instead of at its next poll (about 1 ms), at the cost of a CPU core it keeps busy",
    )
    p.add_argument(
        "--embedding-cache-bytes",
        type=int,
        default=64 << 20,
        help="bytes of media embeddings an encoding worker keeps, keyed by content (0: off)",
    )
    add_media_flags(p)
    add_processor_flags(p)
    group = p.add_argument_group("decoding (workers that decode)")
    group.add_argument("--max-batch", type=int, default=32, help="sequences decoded together in one step")
    group.add_argument(
        "--prefill-batch",
        type=int,
        default=1,
        help="new prompts prefilled together in one forward when they wait together (1: each alone, generate()'s "
        "exact numerics; more: GPU throughput, last-bit differences)",
    )
    group.add_argument(
        "--decode-max-len", type=int, default=4096, help="tokens per sequence in the batch decoder's preallocated cache"
    )
    group.add_argument(
        "--no-batch-decode", dest="batch_decode", action="store_false", help="decode each sequence on its own"
    )
    group.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false", help="run decode steps eagerly")
    add_engine_flags(p)


def _health(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("health and metrics endpoints (for an orchestrator's probes and Prometheus)")
    group.add_argument(
        "--health-port",
        type=int,
        default=int(os.environ.get("MMPIPE_HEALTH_PORT", "0")),
        help="serve /health/ready, /health/live and /metrics on this port (0: not at all)",
    )
    group.add_argument("--health-host", default=os.environ.get("MMPIPE_HEALTH_HOST", "127.0.0.1"))
    group.add_argument(
        "--health-stall-after",
        type=float,
        default=HealthSettings.stall_after_s,
        help="seconds without progress after which /health/live answers 503",
    )


def _bridge(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("MMPIPE_API_KEY"))
    p.add_argument("--request-timeout", type=float, default=300.0)


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="mmpipe", description="Multimodal LLM serving on NATS JetStream.")
    sub = root.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="embedded nats-server + every worker of a mode + the bridge")
    _common(up)
    _model(up)
    _bridge(up)
    up.add_argument("--data-dir", type=Path, default=Path(".mmpipe"))
    up.add_argument("--nats-port", type=int, default=0, help="port of the embedded nats-server (0: any free one)")
    up.add_argument("--workers", default="", help="workers per role, e.g. encode+prefill+decode=2")
    up.add_argument("--external-nats", action="store_true", help="use --nats-url instead of an embedded server")
    _consumer(up, "every role")
    up.add_argument(
        "--worker-health-port",
        type=int,
        default=0,
        help="give the workers consecutive health/metrics ports from this one, in start order (0: none)",
    )

    worker = sub.add_parser("worker", help="run one worker of a role")
    worker.add_argument("role", choices=ROLES)
    _common(worker)
    _model(worker)
    worker.add_argument("--max-inflight", type=int, default=8)
    _consumer(worker, "the worker's role")
    _health(worker)

    bridge = sub.add_parser("bridge", help="run the OpenAI-compatible HTTP bridge")
    _common(bridge)
    _bridge(bridge)

    nats = sub.add_parser("nats", help="run the embedded nats-server with JetStream")
    nats.add_argument("--data-dir", type=Path, default=Path(".mmpipe"))
    nats.add_argument("--host", default="127.0.0.1")
    nats.add_argument("--port", type=int, default=4222)
    nats.add_argument("--log-level", default="INFO")
    _auth(nats)

    send = sub.add_parser("send", help="publish one request over NATS and print the stream")
    _common(send)
    send.add_argument("--model", default=DEFAULT_MODEL)
    send.add_argument("--image", action="append", default=[], help="image URL (data:, https://); repeatable")
    send.add_argument("--max-tokens", type=int, default=32)
    send.add_argument("--temperature", type=float, default=0.0)
    send.add_argument("--json", action="store_true", help="send JSON instead of msgpack")
    send.add_argument("prompt")

    model = sub.add_parser("model", help="built-in models")
    msub = model.add_subparsers(dest="model_command", required=True)
    build = msub.add_parser("build", help="build a built-in model, or a real-size preset, into a directory")
    build.add_argument("name", nargs="?", help="a built-in model")
    build.add_argument("--preset", help="real-size shapes, random weights: qwen2-vl-2b, qwen2-vl-7b (bf16)")
    build.add_argument("--device", default="cuda", help="where a preset's weights are made (cuda: fast)")
    build.add_argument("--out", type=Path, required=True)
    path = msub.add_parser("path", help="print where a built-in model lives (built on first use)")
    path.add_argument("name")
    _bench(sub)
    from pipeline.chaos import add_parser as _chaos

    _chaos(sub)
    return root


def _bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    # No abbreviations: a subcommand's own --mode must not be taken for this parser's --model or --modes.
    bench = sub.add_parser(
        "bench", help="load the bridge with the openai client; or `bench transport`", allow_abbrev=False
    )
    bench.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the bridge's OpenAI base URL")
    bench.add_argument("--model", default=DEFAULT_MODEL)
    bench.add_argument("--api-key", default=os.environ.get("MMPIPE_API_KEY"))
    bench.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    bench.add_argument("--requests", type=int, default=64, help="measured requests (after one warm-up)")
    bench.add_argument("--max-tokens", type=int, default=32, help="tokens per request (min_tokens too)")
    bench.add_argument("--image-size", default="224x224", help="WIDTHxHEIGHT of the synthetic images")
    bench.add_argument("--images-per-request", type=int, default=1)
    bench.add_argument("--seed", type=int, default=0, help="seed of the synthetic images")
    bench.add_argument("--json", action="store_true", help="print machine-readable results")
    bench.add_argument("--compare-modes", action="store_true", help="start `mmpipe up` per mode, same load on each")
    bench.add_argument("--modes", default="epd,e-pd,e-p-d,ep-d", help="with --compare-modes")
    bench.add_argument("--transport", choices=("auto", "nixl", "nats"), default="nixl", help="with --compare-modes")
    bench.add_argument(
        "--concurrencies", default="", help="with --compare-modes: comma-separated levels, each a run (e.g. 1,8,32)"
    )
    bench.add_argument("--device", default="cpu", help="with --compare-modes: the workers' device (cuda on a GPU)")
    bench.add_argument(
        "--up-arg", action="append", default=[], help="with --compare-modes: a flag for `mmpipe up` (repeatable)"
    )
    bench.add_argument(
        "--hf-baseline",
        action="store_true",
        help="with --compare-modes: plain transformers generate() on the same requests, the ratios' baseline",
    )
    bench.add_argument("--log-level", default="ERROR", help="ERROR: the results alone")
    bsub = bench.add_subparsers(dest="bench_command")
    transport = bsub.add_parser("transport", help="tensor transfer GB/s between two processes vs. memcpy")
    transport.add_argument("--sizes", default="2MB,20MB", help="tensor sizes (KB/MB/GB decimal, KiB/MiB/GiB)")
    transport.add_argument("--repeats", type=int, default=20, help="measured transfers per size")
    transport.add_argument("--transports", default="nixl,nats")
    transport.add_argument("--nats-url", default=None, help="an existing nats-server (default: start one)")
    transport.add_argument("--json", action="store_true", help="print machine-readable results")
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
    decode = bsub.add_parser("decode", help="batch decoder vs generate() and the HBM roofline (GPU)")
    add_decode_arguments(decode)
    encode = bsub.add_parser("encode", help="encoder images/s: one image per call vs --encode-batch (GPU)")
    add_encode_arguments(encode)
    scale = bsub.add_parser("scale", help="throughput with 1, 2, 4 workers of a role; R1 vs R3 streams on a cluster")
    add_scale_arguments(scale)


def _config(args: argparse.Namespace) -> PipelineConfig:
    d = ConsumerSettings()
    consumer = ConsumerSettings(
        ack_wait_s=args.ack_wait,
        max_deliver=getattr(args, "max_deliver", d.max_deliver),
        max_ack_pending=getattr(args, "max_ack_pending", d.max_ack_pending),
    )
    tags = tuple(t.strip() for t in (args.placement_tags or "").split(",") if t.strip())
    cluster = args.placement_cluster or None
    if args.replicas is not None and args.replicas < 1:
        raise SystemExit("mmpipe: --replicas must be at least 1")
    if args.queue_max_msgs < 1 or args.queue_max_bytes < 1:
        raise SystemExit("mmpipe: --queue-max-msgs and --queue-max-bytes must be positive")
    queues = StreamLimits(max_msgs=args.queue_max_msgs, max_bytes=args.queue_max_bytes)
    return PipelineConfig(
        nats_url=args.nats_url,
        namespace=args.namespace,
        mode=args.mode,
        requests_limits=queues,
        hop_limits=queues,
        consumer=consumer,
        replicas=args.replicas,
        placement=Placement(cluster=cluster, tags=tags) if cluster or tags else None,
    )


def _bridge_settings(args: argparse.Namespace) -> BridgeSettings:
    return BridgeSettings(
        host=args.host, port=args.port, api_key=args.api_key or None, request_timeout_s=args.request_timeout
    )


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        _apply_auth(args)
    except ValueError as exc:
        raise SystemExit(f"mmpipe: {exc}") from None
    mm_logging.configure(getattr(args, "log_level", "INFO"))
    if args.command == "worker":
        from pipeline.serve import WorkerSettings, run_worker
        from pipeline.transport.base import TransportSettings

        settings = WorkerSettings(
            model=args.model,
            served_model_name=args.served_model_name,
            device=args.device,
            max_inflight=args.max_inflight,
            allow_internal_media=args.allow_internal_media,
            media=media_policy(args),
            limits=processor_limits(args),
            max_batch=args.max_batch,
            prefill_batch=args.prefill_batch,
            decode=DecodeSettings(
                batched=args.batch_decode,
                slots=args.max_batch,
                max_len=args.decode_max_len,
                cuda_graphs=args.cuda_graphs,
            ),
            modalities=args.modalities,
            embedding_cache_bytes=args.embedding_cache_bytes,
            drain_grace_s=args.drain_grace,
            transport=args.transport,
            tensor_settings=TransportSettings(
                budget_bytes=args.tensor_budget_mb << 20,
                ttl_s=args.tensor_ttl,
                progress_thread=args.nixl_progress_thread,
            ),
            health=HealthSettings(port=args.health_port, host=args.health_host, stall_after_s=args.health_stall_after),
            engine=args.engine,
            vllm_args=vllm_args(args),
            vllm_ec_path=args.vllm_ec_path,
            vllm_kv=vllm_kv_settings(args),
            vllm_storage_ttl_s=args.vllm_storage_ttl,
        )
        try:
            _run(run_worker(args.role, _config(args), settings))
        except ProvisioningConflict as exc:
            raise SystemExit(f"mmpipe: {exc}") from None
    elif args.command == "bridge":
        from pipeline.serve import run_bridge

        try:
            _run(run_bridge(_config(args), _bridge_settings(args)))
        except ProvisioningConflict as exc:
            raise SystemExit(f"mmpipe: {exc}") from None
    elif args.command == "nats":
        from pipeline.launcher import run_nats

        return run_nats(args.data_dir, args.host, args.port)
    elif args.command == "up":
        from pipeline.launcher import up

        return up(args, _config(args), _bridge_settings(args))
    elif args.command == "send":
        from pipeline.send import send

        return _run_send(send, args)
    elif args.command == "model":
        from stages.models import build_builtin, builtin_path

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

        return bench(args)
    elif args.command == "chaos":
        from pipeline.chaos import main as chaos

        return chaos(args)
    return 0


def _run_send(send: object, args: argparse.Namespace) -> int:
    result: list[int] = []

    async def go() -> None:
        result.append(await send(args, _config(args)))  # type: ignore[operator]

    _run(go())
    return result[0]


if __name__ == "__main__":
    sys.exit(main())
