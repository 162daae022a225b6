"""Models: built-in tiny checkpoints, the offline Qwen tokenizer, model spec resolution.

Importing this package does not import torch or transformers.
"""

from __future__ import annotations

from stages.models.builtin import BUILTIN_MODELS, DEFAULT_MODEL, build_builtin, builtin_path, mmpipe_home
from stages.models.resolve import SUPPORTED_ARCHITECTURES, ModelSpec, UnsupportedModel, resolve_model

__all__ = [
    "BUILTIN_MODELS",
    "DEFAULT_MODEL",
    "SUPPORTED_ARCHITECTURES",
    "ModelSpec",
    "UnsupportedModel",
    "build_builtin",
    "builtin_path",
    "mmpipe_home",
    "resolve_model",
]
