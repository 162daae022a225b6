"""The engine: runs a checkpoint's Hugging Face model class on torch (CPU or CUDA).

Importing this package imports torch and transformers.
stages.engine.reference holds the plain-generate() reference used by
tests and benchmarks.
"""

from __future__ import annotations

from stages.engine.sampling import SamplingConfig, select_token
from stages.engine.sequence import KvState, Sequence
from stages.engine.torch_engine import TorchEngine
from stages.engine_settings import DecodeSettings
from stages.families import MediaEmbedding

__all__ = ["DecodeSettings", "KvState", "MediaEmbedding", "SamplingConfig", "Sequence", "TorchEngine", "select_token"]
