"""``mmpipe bench --compare-deployments``: the deployments it makes of a
set of cards, the ones it is given, and a run on this CPU (two "cards",
three stacks one after another, the tiny model)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.bench.deployments import BASELINE, default_deployments, parse_deployment
from pipeline.cli import parser
from pipeline.launcher import parse_workers

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("cards", [1, 2, 3, 4])
def test_the_default_deployments_share_out_every_card_once(cards: int) -> None:
    devices = [f"cuda:{i}" for i in range(cards)]
    deployments = default_deployments(devices)
    assert deployments[0].name == BASELINE and deployments[0].mode == "epd"
    assert [d.mode for d in deployments[1:]] == ["e-pd", "ep-d", "e-p-d"][: 0 if cards == 1 else 2 if cards == 2 else 3]
    for d in deployments:
        plans = parse_workers(d.workers, d.mode)
        placed = [plan.device_of(i) for plan in plans.values() for i in range(plan.count)]
        assert sorted(placed) == devices, (d.name, placed)  # one worker a card, every card used
    assert deployments[0].workers == f"encode+prefill+decode={cards}@{','.join(devices)}"


def test_a_named_deployment_is_read_as_mmpipe_up_would() -> None:
    d = parse_deployment("e-p-d 2:1:1=e-p-d:encode=2@cuda:0,cuda:1,prefill=1@cuda:2,decode=1@cuda:3")
    assert (d.name, d.mode) == ("e-p-d 2:1:1", "e-p-d")
    assert d.stack() == (
        "e-p-d 2:1:1",
        "e-p-d",
        ("--workers", "encode=2@cuda:0,cuda:1,prefill=1@cuda:2,decode=1@cuda:3"),
    )
    with pytest.raises(SystemExit, match="NAME=MODE:WORKERS"):
        parse_deployment("e-p-d:encode=1")
    with pytest.raises(SystemExit, match="unknown mode 'e-x'"):
        parse_deployment("x=e-x:encode=1")
    with pytest.raises(SystemExit, match="not a role of mode e-pd"):
        parse_deployment("x=e-pd:decode=1@cuda:0")
    args = parser().parse_args(["bench", "--compare-deployments", "--deployment", "a=epd:encode+prefill+decode=2"])
    assert args.compare_deployments and args.deployment == ["a=epd:encode+prefill+decode=2"] and args.probes == 4


@pytest.mark.e2e
def test_compare_deployments_runs_each_on_the_same_cards_and_checks_their_answers(tiny_model_dir: Path) -> None:
    cmd = [sys.executable, "-m", "pipeline.cli", "bench", "--compare-deployments", "--deploy-devices", "cpu,cpu"]
    cmd += ["--model", str(tiny_model_dir), "--concurrencies", "2", "--requests", "4", "--max-tokens", "4"]
    cmd += ["--image-size", "64x64", "--probes", "2", "--transport", "nixl", "--json"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads(done.stdout)
    assert [r["mode"] for r in rows] == [BASELINE, "e-pd 1:1", "ep-d 1:1"]
    for row in rows:
        assert row["summary"]["completed"] == 4 and row["summary"]["failed"] == 0
        assert row["baseline"] == BASELINE
        # float32 on a CPU: every split answers exactly as the replicas do.
        assert len(row["answers"]) == 2 and all(row["answers"]) and row["same_answers"] == 2
    assert rows[0]["ratios"]["requests_per_s"] == 1.0
