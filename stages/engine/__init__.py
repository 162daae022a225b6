"""The engine: runs a checkpoint's Hugging Face model class on torch (CPU or CUDA).

Importing this package imports torch and transformers.
stages.engine.reference holds the plain-generate() reference used by
tests and benchmarks.
"""

from __future__ import annotations

from stages.engine.sampling import SamplingConfig, select_token
from stages.engine.torch_engine import EncodedImage, KvState, Sequence, TorchEngine

__all__ = ["EncodedImage", "KvState", "SamplingConfig", "Sequence", "TorchEngine", "select_token"]
