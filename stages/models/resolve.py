"""Turn a model spec (a built-in name or a local checkpoint directory) into a ModelSpec.

Nothing is downloaded: there is no model hub here. This module reads
config.json only (no torch import), except that a built-in is built on
first use.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from schemas.errors import ErrorCode, MmpipeError, ModelNotFound
from stages.models.builtin import BUILTIN_MODELS, builtin_path

# Architecture (config.json "architectures") -> family name (stages.families).
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "Qwen2VLForConditionalGeneration": "qwen2_vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    "LlavaForConditionalGeneration": "llava",
    "LlavaNextVideoForConditionalGeneration": "llava_next_video",
    "Qwen2AudioForConditionalGeneration": "qwen2_audio",
}

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class UnsupportedModel(MmpipeError):
    """A checkpoint whose architecture no family here runs. Not retryable."""

    code = ErrorCode.INVALID_REQUEST
    http_status = 400


@dataclass(frozen=True)
class ModelSpec:
    served_name: str  # the name clients put in "model"
    path: Path  # checkpoint directory
    family: str  # stages.families name, e.g. "qwen2_vl"


def resolve_model(spec: str, served_model_name: str | None = None) -> ModelSpec:
    """Resolve `spec`: a built-in name (see BUILTIN_MODELS) or a local checkpoint directory.

    Built-in names win over a directory of the same name in the working
    directory; write "./name" for the directory.
    """
    if spec in BUILTIN_MODELS:
        path = builtin_path(spec)
        return ModelSpec(served_name=served_model_name or spec, path=path, family=_family(path))
    path = Path(spec).expanduser()
    if not path.exists():
        if _HUB_ID.match(spec) and not spec.startswith("."):
            raise ModelNotFound(
                f"model {spec!r} is not a local directory; it looks like a Hugging Face Hub id, but hub downloads "
                "are not possible here. Pass a local checkpoint directory (one with config.json and weights), "
                f"or a built-in model: {', '.join(BUILTIN_MODELS)}"
            )
        raise ModelNotFound(
            f"model {spec!r}: no such directory and not a built-in model (built-ins: {', '.join(BUILTIN_MODELS)})"
        )
    if not path.is_dir():
        raise ModelNotFound(f"model {spec!r} is not a directory; pass a checkpoint directory")
    path = path.resolve()
    return ModelSpec(served_name=served_model_name or path.name, path=path, family=_family(path))


def _family(path: Path) -> str:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelNotFound(f"{path} is not a Hugging Face checkpoint directory: it has no config.json")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise UnsupportedModel(f"{config_file} is not readable JSON: {exc}") from None
    architectures = config.get("architectures") if isinstance(config, dict) else None
    for arch in architectures if isinstance(architectures, list) else []:
        if arch in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[arch]
    raise UnsupportedModel(
        f"{path}: architectures {architectures!r} are not supported; supported architectures: "
        f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
    )
