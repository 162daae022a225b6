"""``--engine`` and vLLM's pass-through engine arguments, for ``mmpipe
worker`` and ``mmpipe up`` (which forwards them to the roles vLLM runs)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from schemas.routes import MODES
from stages.vllm_engine.args import (
    KV_CONNECTORS,
    KV_CONSUMER_ROLES,
    KV_PRODUCER_ROLES,
    STORAGE_TTL_S,
    VLLM_ROLES,
    KvConnectorSettings,
    engine_arg_flags,
    engine_args,
    kv_connector_flags,
)

ENGINES = ("torch", "vllm")


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("engine (the roles that prefill and decode)")
    group.add_argument(
        "--engine",
        choices=ENGINES,
        default="torch",
        help=f"torch: the built-in engine; vllm: vLLM for the roles {', '.join(VLLM_ROLES)} (needs the vllm extra)",
    )
    group.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a vLLM engine argument, e.g. max_model_len=4096 or dtype=float32 (repeatable; JSON values)",
    )
    group.add_argument(
        "--vllm-args-file", type=Path, default=None, help="a JSON object of vLLM engine arguments (flags win)"
    )
    group.add_argument(
        "--vllm-kv-connector",
        choices=KV_CONNECTORS,
        default="example",
        help="how vLLM's prefill hands the KV cache to vLLM's decode: example (ExampleConnector, files in "
        "--vllm-kv-path, one host or a shared volume) or nixl (NixlConnector; needs nixl). "
        "--vllm-arg kv_transfer_config=... overrides",
    )
    group.add_argument(
        "--vllm-kv-path",
        default="",
        help="ExampleConnector's folder, the same for prefill and decode workers "
        "(default: mmpipe up's <data-dir>/vllm-kv, a worker's <tmp>/mmpipe-vllm-kv)",
    )
    group.add_argument(
        "--vllm-kv-port",
        type=int,
        default=0,
        help="NixlConnector's side-channel port of this worker (0: a free one; mmpipe up always uses 0). "
        "Other hosts reach it at VLLM_NIXL_SIDE_CHANNEL_HOST (set it to this host's address)",
    )
    group.add_argument(
        "--vllm-storage-ttl",
        type=float,
        default=STORAGE_TTL_S,
        metavar="S",
        help="a vLLM worker that writes an example connector's folder (the vLLM encode worker: --vllm-ec-path; "
        "a prefill worker on ExampleConnector: --vllm-kv-path) deletes what in it has not changed for S "
        "seconds, every S/4 (0: never)",
    )
    add_vllm_encoder_flags(group)


def add_vllm_encoder_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--vllm-ec-path",
        default="",
        help="the folder of vLLM's encoder-cache connector (ECExampleConnector), seen by the vLLM encode worker "
        "(which writes it) and the vLLM prefill workers (which read it); mmpipe up: <data-dir>/vllm-ec",
    )
    group.add_argument(
        "--vllm-encoder",
        action="store_true",
        help="mmpipe up --engine vllm --mode e-pd|e-p-d: the encode workers run vLLM encoder-only (images only) "
        "instead of mmpipe's built-in encoder",
    )


def vllm_args(args: argparse.Namespace) -> dict[str, Any]:
    try:
        return engine_args(args.vllm_arg, args.vllm_args_file)
    except ValueError as exc:
        raise SystemExit(f"mmpipe: {exc}") from None


def vllm_kv_settings(args: argparse.Namespace) -> KvConnectorSettings:
    return KvConnectorSettings(args.vllm_kv_connector, args.vllm_kv_path, args.vllm_kv_port)


def check_mode(engine: str, mode: str, vllm_encoder: bool = False) -> None:
    """``mmpipe up --engine vllm``: every hop of the mode is an encode hop
    (built in) or one vLLM runs."""
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


def engine_flag_args(
    role: str,
    engine: str,
    args: dict[str, Any],
    kv: KvConnectorSettings | None = None,
    storage_ttl_s: float = STORAGE_TTL_S,
) -> list[str]:
    """The flags that give a child worker of ``role`` its engine: vLLM's
    roles get --engine vllm and its arguments (and a role on either side of
    the KV hand-off its connector), the others the built-in one."""
    if engine != "vllm" or role not in VLLM_ROLES:
        return []
    out = ["--engine", "vllm", *engine_arg_flags(args), *_ttl_flag(storage_ttl_s)]
    if kv is not None and role in KV_PRODUCER_ROLES + KV_CONSUMER_ROLES:
        out += kv_connector_flags(kv)
    return out


def vllm_encoder_flag_args(
    role: str, engine: str, args: dict[str, Any], ec_path: str, storage_ttl_s: float = STORAGE_TTL_S
) -> list[str]:
    """``mmpipe up --engine vllm --vllm-encoder``: the encode role runs vLLM
    encoder-only, writing ``ec_path`` (and pruning it); every vLLM role reads it."""
    if engine != "vllm" or not ec_path:
        return []
    if role == "encode":
        return ["--engine", "vllm", *engine_arg_flags(args), *_ttl_flag(storage_ttl_s), "--vllm-ec-path", ec_path]
    return ["--vllm-ec-path", ec_path] if role in VLLM_ROLES else []


def _ttl_flag(storage_ttl_s: float) -> list[str]:
    """--vllm-storage-ttl where it is not the default."""
    return [] if storage_ttl_s == STORAGE_TTL_S else ["--vllm-storage-ttl", str(storage_ttl_s)]
