"""`mmpipe bench scale` end to end, small: one decode worker on the embedded
server, then R3 streams on a 3-node loopback cluster, every request served."""

from __future__ import annotations

import pytest

from pipeline.bench import main as bench
from pipeline.bench.scale import measure
from pipeline.cli import parser

FLAGS = ["bench", "--concurrency", "2", "--requests", "4", "--max-tokens", "4", "--image-size", "32x32", "scale"]


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_scale_runs_workers_and_replicas(capsys: pytest.CaptureFixture[str]) -> None:
    args = parser().parse_args([*FLAGS, "--workers", "1", "--replicas", "3", "--transport", "nats"])
    assert bench(args) == 0
    out = capsys.readouterr().out
    assert "mmpipe bench scale  mode=e-p-d  role=decode" in out
    rows = {
        line.split()[0] + (" " + line.split()[1] if line.startswith("decode") else ""): line
        for line in out.splitlines()[3:]
    }
    assert set(rows) == {"decode x1", "R3"}
    assert all(line.split()[2 if key == "R3" else 3] == "0" for key, line in rows.items())  # no failed request


def test_a_role_not_in_the_mode_is_refused() -> None:
    args = parser().parse_args([*FLAGS, "--mode", "epd", "--role", "decode"])
    with pytest.raises(SystemExit, match="mode epd has roles encode\\+prefill\\+decode"):
        measure(args)
