"""One kind of log line per process: what libraries log through the
standard library (nats-py, aiohttp, vLLM) is rendered as structlog's own
lines are, not printed bare among them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import logging, warnings
import structlog
from pipeline import logging as mm_logging

mm_logging.configure("info", json=True)
mm_logging.configure("info", json=True)  # again: still one line per record
structlog.get_logger("mmpipe").info("worker_started", role="decode")
logging.getLogger("nats.aio.client").warning("lost %s", "connection")
logging.getLogger("aiohttp.access").debug("below the level")
try:
    1 / 0
except ZeroDivisionError:
    logging.getLogger("aiohttp.server").exception("handler failed")
warnings.warn("old api", DeprecationWarning, stacklevel=1)
"""


def test_standard_library_records_come_out_as_structlog_json_lines() -> None:
    done = subprocess.run(
        [sys.executable, "-W", "always", "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=True
    )
    lines = [json.loads(line) for line in done.stderr.splitlines()]
    assert [(r["event"], r["level"]) for r in lines[:3]] == [
        ("worker_started", "info"),
        ("lost connection", "warning"),
        ("handler failed", "error"),
    ]
    assert lines[0]["role"] == "decode" and "timestamp" in lines[0]
    assert lines[1]["logger"] == "nats.aio.client" and "timestamp" in lines[1]
    assert "ZeroDivisionError" in lines[2]["exception"]
    assert lines[3]["logger"] == "py.warnings" and "old api" in lines[3]["event"]
    assert len(lines) == 4  # the debug record is below the level


LOUD = """
import structlog
from pipeline import logging as mm_logging

mm_logging.configure("info", json=True)
log = structlog.get_logger("mmpipe")
for i in range(2000):
    log.info("health_endpoints_started", url="http://127.0.0.1:41187", i=i)
"""


def test_processes_sharing_one_unbuffered_stderr_write_whole_lines(tmp_path: Path) -> None:
    # As `mmpipe up` runs its children: one log file, each process unbuffered.
    log = tmp_path / "up.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as out:
        procs = [
            subprocess.Popen([sys.executable, "-c", LOUD], stderr=out, stdout=subprocess.DEVNULL, env=env)
            for _ in range(4)
        ]
        assert [p.wait(timeout=120) for p in procs] == [0] * 4
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(lines) == 4 * 2000
    assert sorted(r["i"] for r in lines) == sorted(list(range(2000)) * 4)
