"""``mmpipe bench --compare-frontend-decode``'s CPU figures: a stack's
processes read from /proc, each by its role, the processes a worker started
(its media decoding pool) counted with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from pipeline.bench.cpu import _children, stack_cpu_s

# A child that burns 0.4 s of CPU (a plain process, as a decoding pool's is), says so and waits.
_BURN = (
    "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\nprint(flush=True)\ntime.sleep(60)"
)
_WORKER = f"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", {_BURN!r}], stdout=subprocess.PIPE)
child.stdout.readline()
print("burned", flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_workers_child_counts_as_its_role() -> None:
    args = [sys.executable, "-c", _WORKER, "pipeline.cli", "worker", "encode"]
    with subprocess.Popen(args, stdout=subprocess.PIPE, text=True) as worker:
        try:
            assert worker.stdout is not None and worker.stdout.readline().strip() == "burned"
            cpu = stack_cpu_s(worker.pid)
            assert set(cpu) == {"encode"}
            assert cpu["encode"] >= 0.4  # the child's 0.4 s, and the worker's own start
        finally:
            for pid in _children(worker.pid):
                os.kill(pid, signal.SIGKILL)
            worker.kill()
