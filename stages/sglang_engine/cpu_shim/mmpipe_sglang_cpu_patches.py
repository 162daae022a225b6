"""What SGLang's PD disaggregation needs on a CPU host, for the CPU test venv
(.venv-sglang, deploy/install-sglang.sh) only: imported by the venv's
``mmpipe_sglang_cpu_shim.pth`` at every interpreter start, so it reaches
SGLang's scheduler processes too (spawned, not forked).

SGLang 0.5.23's NIXL transfer engine labels the KV pool's memory ``VRAM``
on both sides (the prefill side by default in ``_normalize_kv_mem_kinds``,
the decode side hard-coded), and UCX without CUDA refuses to register host
memory as VRAM (``NIXL_ERR_BACKEND``). On a CPU device the pool is host
memory: labelled ``DRAM`` here, as SGLang's module loads. Nothing changes
where the device is not the CPU, and nothing is imported before SGLang
imports that module itself.

Never installed on a GPU host.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

NIXL_CONN = "sglang.srt.disaggregation.nixl.conn"


def _on_cpu() -> bool:
    from sglang.srt.runtime_context import get_device

    return bool(get_device().device == "cpu")


def _patch_nixl(module: ModuleType) -> None:
    normalize = module._normalize_kv_mem_kinds

    def kv_mem_kinds(kinds: Any, expected_len: int) -> list[str]:
        kinds = normalize(kinds, expected_len)
        return ["DRAM"] * len(kinds) if _on_cpu() else list(kinds)

    setattr(module, "_normalize_kv_mem_kinds", kv_mem_kinds)  # noqa: B010 (a module's attribute mypy cannot see)


class _PatchOnLoad(importlib.abc.MetaPathFinder):
    """Finds nothing itself: runs the patch after SGLang's module executes."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != NIXL_CONN:
            return None
        sys.meta_path.remove(self)  # the real finders find it
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        execute = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            _patch_nixl(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if not any(isinstance(finder, _PatchOnLoad) for finder in sys.meta_path):
    sys.meta_path.insert(0, _PatchOnLoad())
