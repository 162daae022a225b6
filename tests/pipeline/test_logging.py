"""One kind of log line per process: what libraries log through the
standard library (nats-py, aiohttp, vLLM) is rendered as structlog's own
lines are, not printed bare among them."""

from __future__ import annotations

import json
import subprocess
import sys

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
