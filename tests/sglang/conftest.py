"""tests/sglang: mmpipe with ``--engine sglang``, run in the SGLang venv only.

``deploy/install-sglang.sh`` builds that venv (.venv-sglang) and
``deploy/test-sglang.sh`` runs these tests there. Where SGLang does not
import (the main .venv) the files here are not collected at all, so the
main suite neither runs nor counts them.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest


def _sglang_importable() -> bool:
    try:
        return importlib.util.find_spec("sglang") is not None
    except (ImportError, ValueError):
        return False


collect_ignore_glob = [] if _sglang_importable() else ["test_*.py"]

# What SGLang wants on a CPU host (deploy/test-sglang.sh sets the same): its
# CPU engine (not vLLM's rotary), no inductor compile of the vision rotary.
if _sglang_importable():
    for _key, _value in {"SGLANG_USE_CPU_ENGINE": "1", "TORCH_COMPILE_DISABLE": "1", "HF_HUB_OFFLINE": "1"}.items():
        os.environ.setdefault(_key, _value)


def pytest_configure(config: pytest.Config) -> None:
    # The main config turns every warning into an error; these come from
    # SGLang's own imports on a CPU host, not from mmpipe.
    for line in (
        "ignore::DeprecationWarning:sglang.*",
        "ignore::FutureWarning:sglang.*",
        "ignore::UserWarning:sglang.*",
        "ignore:.*Triton.*:UserWarning",
    ):
        config.addinivalue_line("filterwarnings", line)


_exit_status = 0


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _exit_status
    _exit_status = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """This venv's test process (torch 2.14's CUDA build on a CPU host)
    crashes in native code as the interpreter tears down, after every test
    has run and been reported (SIGSEGV, no Python frame; mmpipe's own
    processes under test exit cleanly, which the stacks assert): leave with
    pytest's status instead of the teardown's."""
    if _sglang_importable():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status)
