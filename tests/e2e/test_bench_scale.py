"""`mmpipe bench scale` end to end, small (one decode worker on the embedded
server, every request served), and its loopback cluster holding mmpipe's
streams at R3. The R1-vs-R3 stacks themselves are measured by the command,
not here: five worker processes and three servers on CI's two busy cores
start too slowly to be a fair test."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.bench import main as bench
from pipeline.bench.scale import measure
from pipeline.cli import parser
from pipeline.config import PipelineConfig
from pipeline.connection import connect
from pipeline.nats_cluster import LocalCluster
from pipeline.streams import ensure_streams

FLAGS = ["bench", "--concurrency", "2", "--requests", "4", "--max-tokens", "4", "--image-size", "32x32", "scale"]


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_scale_runs_workers_and_replicas(capsys: pytest.CaptureFixture[str]) -> None:
    args = parser().parse_args([*FLAGS, "--workers", "1", "--replicas", "", "--transport", "nats"])
    assert bench(args) == 0
    out = capsys.readouterr().out
    assert "mmpipe bench scale  mode=e-p-d  role=decode" in out
    rows = {
        line.split()[0] + (" " + line.split()[1] if line.startswith("decode") else ""): line
        for line in out.splitlines()[3:]
    }
    assert set(rows) == {"decode x1"}
    assert rows["decode x1"].split()[3] == "0"  # no failed request


def test_a_role_not_in_the_mode_is_refused() -> None:
    args = parser().parse_args([*FLAGS, "--mode", "epd", "--role", "decode"])
    with pytest.raises(SystemExit, match="mode epd has roles encode\\+prefill\\+decode"):
        measure(args)


async def test_the_local_cluster_holds_mmpipes_streams_at_r3(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path)
    cluster.start()
    try:
        nc, js = await connect(cluster.url, "test-r3")
        try:
            config = PipelineConfig(nats_url=cluster.url, namespace="r3", replicas=3)
            await ensure_streams(js, config)
            info = await js.stream_info(config.subjects.stream("decode"))
            assert info.config.num_replicas == 3 and info.cluster is not None
            assert len(info.cluster.replicas or []) == 2  # the leader and two copies
        finally:
            await nc.close()
    finally:
        cluster.stop()
