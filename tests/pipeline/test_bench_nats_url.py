"""``mmpipe bench --breakdown`` finds the stack's NATS as ``mmpipe send``
does, through the same ``nats_url_beside_up`` (``--nats-url``, else what
the ``mmpipe up`` of ``--data-dir`` recorded), and says so when no server
answers there, rather than waiting for one for ever."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pipeline.chaos.stack import free_port
from pipeline.config import DEFAULT_NATS_URL
from pipeline.discovery import nats_url_beside_up, record_nats_url


def test_the_url_given_wins_then_the_one_mmpipe_up_recorded_then_the_default(tmp_path: Path) -> None:
    data = tmp_path / "data"
    assert nats_url_beside_up(None, data, default=DEFAULT_NATS_URL)[0] == DEFAULT_NATS_URL
    record_nats_url(data, "nats://127.0.0.1:40001")
    url, source = nats_url_beside_up(None, data, default=DEFAULT_NATS_URL)
    assert url == "nats://127.0.0.1:40001" and str(data) in source
    given = nats_url_beside_up("nats://127.0.0.1:40002", data, default=DEFAULT_NATS_URL)
    assert given == ("nats://127.0.0.1:40002", "--nats-url")


def test_no_server_at_the_url_ends_the_bench_with_a_message(tmp_path: Path) -> None:
    nowhere = f"nats://127.0.0.1:{free_port()}"
    done = subprocess.run(
        [
            sys.executable, "-m", "pipeline.cli", "bench", "--breakdown", "--nats-url", nowhere,
            "--url", f"http://127.0.0.1:{free_port()}/v1", "--requests", "1", "--concurrency", "1",
        ],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2],
    )  # fmt: skip
    assert done.returncode != 0
    assert f"no NATS server answered at {nowhere} (--nats-url)" in done.stderr, done.stderr[-2000:]
