"""``mmpipe up --workers ROLE=N@DEVICE,...``: which device each worker of
a role gets, and how it reaches the worker (its settings, or for vLLM the
cards it sees)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pipeline.cli import parser
from pipeline.launcher import RolePlan, parse_workers, plan
from pipeline.settings import UpProcess, load_kind


def test_each_roles_workers_take_its_devices_in_turn() -> None:
    plans = parse_workers("encode=1@cuda:0,prefill=1@cuda:1,decode=3@cuda:2,cuda:3", "e-p-d")
    assert parse_workers("prefill+decode=1@cuda:0+1", "e-pd")["prefill+decode"].devices == ("cuda:0+1",)
    assert plans == {
        "processor": RolePlan(0),
        "encode": RolePlan(1, ("cuda:0",)),
        "prefill": RolePlan(1, ("cuda:1",)),
        "decode": RolePlan(3, ("cuda:2", "cuda:3")),
    }
    assert [plans["decode"].device_of(i) for i in range(3)] == ["cuda:2", "cuda:3", "cuda:2"]
    # Unplaced roles keep --device; counts alone as before.
    assert parse_workers("prefill+decode=2", "e-pd")["prefill+decode"] == RolePlan(2)
    assert parse_workers("", "e-pd")["encode"].device_of(0) is None


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("decode=2@gpu0", "'gpu0' is not a device"),
        ("decode=2@cuda:x", "'cuda:x' is not a device"),
        ("decode=2@cpu:0", "'cpu:0' is not a device"),
        ("decode=2@", "names no device"),
        ("cuda:1,decode=1", "'cuda:1' is not a role"),
        ("decode=1,cuda:1", "'cuda:1' is not a role"),
        ("decode=0@cuda:0", "a count of at least 1"),
    ],
)
def test_a_bad_placement_is_refused_with_what_is_wrong(spec: str, says: str) -> None:
    with pytest.raises(SystemExit, match=says):
        parse_workers(spec, "e-p-d")


Placed = tuple[str, str, str | None, int | None]


def _children(engine: str, tmp_path: Path, placed: str = "2@cuda:2,cuda:3") -> list[Placed]:
    argv = ["up", "--mode", "e-pd", "--engine", engine, "--workers", f"encode=1@cuda:1,prefill+decode={placed}"]
    up: UpProcess = load_kind("up", parser().parse_args(argv), {}).settings
    up = dataclasses.replace(up, worker=dataclasses.replace(up.worker, model="/models/m", served_model_name="m"))
    out = []
    for child in plan(up, "nats://embedded:4222", parse_workers(up.up.workers, "e-pd"), tmp_path):
        if child.role in ("bridge", "processor"):
            continue  # on the CPU wherever they run
        args = parser().parse_args(child.argv)
        settings = load_kind(args.command, args, child.env).settings
        tp = settings.worker.vllm_args.get("tensor_parallel_size")
        out.append((child.role, settings.worker.device, child.env.get("CUDA_VISIBLE_DEVICES"), tp))
    return out


def test_a_built_in_worker_gets_its_device_and_sees_every_card(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert _children("torch", tmp_path) == [
        ("encode", "cuda:1", None, None),
        ("prefill+decode", "cuda:2", None, None),
        ("prefill+decode", "cuda:3", None, None),
    ]
    with pytest.raises(SystemExit, match="runs a worker on one card"):
        _children("torch", tmp_path, "1@cuda:2+3")


def test_a_vllm_worker_sees_only_its_own_card(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    # The encode worker runs the built-in encoder (no --vllm-encoder): it keeps every card in sight.
    assert _children("vllm", tmp_path) == [
        ("encode", "cuda:1", None, None),
        ("prefill+decode", "cuda", "2", None),
        ("prefill+decode", "cuda", "3", None),
    ]
    # One worker over two cards: vLLM's tensor parallelism over them.
    assert _children("vllm", tmp_path, "1@cuda:2+3")[1:] == [("prefill+decode", "cuda", "2,3", 2)]


def test_the_image_stage_is_placed_as_any_role_once_there_is_one() -> None:
    assert parse_workers("", "epd", image=True)["generate-image"] == RolePlan(1)
    placed = parse_workers("encode+prefill+decode=1@cuda:0,generate-image=2@cuda:1", "epd", image=True)
    assert placed["generate-image"] == RolePlan(2, ("cuda:1",))
    assert "generate-image" not in parse_workers("", "epd")
    with pytest.raises(SystemExit, match="generate-image needs --image-model"):
        parse_workers("generate-image=1", "epd")


def _torch_threads(argv: list[str], tmp_path: Path) -> list[tuple[str, int | None]]:
    up: UpProcess = load_kind("up", parser().parse_args(["up", *argv]), {}).settings
    up = dataclasses.replace(up, worker=dataclasses.replace(up.worker, model="/models/m", served_model_name="m"))
    out = []
    for child in plan(up, "nats://embedded:4222", parse_workers(up.up.workers, up.common.pipeline.mode), tmp_path):
        if child.role != "bridge":
            args = parser().parse_args(child.argv)
            out.append((child.role, load_kind(args.command, args, child.env).settings.worker.torch_threads))
    return out


def test_engines_sharing_this_hosts_cpu_share_its_cores_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each CPU worker's engine keeps one OpenMP team: a role's replicas on
    one host's CPU get the cores shared out (at least one each), not every
    core each; a split pipeline's roles (one worker each), a worker on a
    GPU, or --torch-threads given: untouched."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    four = _torch_threads(["--device", "cpu", "--workers", "encode+prefill+decode=4"], tmp_path)
    assert four == [("processor", None)] + [("encode+prefill+decode", 2)] * 4
    three = _torch_threads(["--device", "cpu", "--mode", "e-p-d"], tmp_path)
    assert three == [("processor", None), ("encode", None), ("prefill", None), ("decode", None)]
    split = _torch_threads(["--device", "cpu", "--mode", "e-pd", "--workers", "encode=1,prefill+decode=3"], tmp_path)
    assert split == [("processor", None), ("encode", 2)] + [("prefill+decode", 2)] * 3
    assert _torch_threads(["--device", "cpu"], tmp_path) == [("processor", None), ("encode+prefill+decode", None)]
    given = _torch_threads(
        ["--device", "cpu", "--torch-threads", "3", "--workers", "encode+prefill+decode=4"], tmp_path
    )
    assert {t for role, t in given if role != "processor"} == {3}
    gpu = _torch_threads(["--workers", "encode+prefill+decode=2@cuda:0,cuda:1"], tmp_path)
    assert gpu == [("processor", None), ("encode+prefill+decode", None), ("encode+prefill+decode", None)]
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert (
        _torch_threads(["--device", "cpu", "--workers", "encode+prefill+decode=4"], tmp_path)[1:]
        == [("encode+prefill+decode", 1)] * 4
    )
