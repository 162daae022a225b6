"""``--engine vllm`` as the CLI and ``build_stage`` take it, in any venv:
pass-through engine arguments, the modes and roles it serves, and a clear
start failure where vLLM is not installed (the vLLM runs themselves are
tests/vllm, in the vLLM venv)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from pipeline.cli import parser
from pipeline.config import PipelineConfig
from pipeline.engine_flags import check_mode, engine_flag_args, vllm_args
from pipeline.serve import WorkerSettings, build_stage
from stages.models import resolve_model
from stages.vllm_engine.args import engine_args


def test_engine_args_from_a_file_and_flags_json_values_and_dashes(tmp_path: Path) -> None:
    file = tmp_path / "args.json"
    file.write_text(json.dumps({"max-model-len": 1024, "dtype": "bfloat16"}))
    got = engine_args(["dtype=float32", "enforce_eager=true", 'limit_mm_per_prompt={"image": 2}', "x=a b"], file)
    assert got == {
        "max_model_len": 1024,
        "dtype": "float32",  # the flag wins over the file
        "enforce_eager": True,
        "limit_mm_per_prompt": {"image": 2},
        "x": "a b",
    }
    with pytest.raises(ValueError, match="KEY=VALUE"):
        engine_args(["no-value"])
    file.write_text("[1]")
    with pytest.raises(ValueError, match="JSON object"):
        engine_args([], file)


def test_worker_flags_reach_the_settings_and_up_forwards_them_to_vllm_roles_only(tmp_path: Path) -> None:
    args = parser().parse_args(
        ["worker", "prefill+decode", "--engine", "vllm", "--vllm-arg", "max_model_len=512", "--vllm-arg", "dtype=half"]
    )
    assert args.engine == "vllm"
    assert vllm_args(args) == {"max_model_len": 512, "dtype": "half"}
    assert parser().parse_args(["worker", "encode"]).engine == "torch"
    forwarded = engine_flag_args("prefill+decode", "vllm", {"max_model_len": 512, "limit": {"image": 2}})
    assert forwarded == ["--engine", "vllm", "--vllm-arg", "max_model_len=512", "--vllm-arg", 'limit={"image": 2}']
    again = parser().parse_args(["worker", "prefill+decode", *forwarded])
    assert vllm_args(again) == {"max_model_len": 512, "limit": {"image": 2}}
    assert engine_flag_args("encode", "vllm", {"max_model_len": 512}) == []
    assert engine_flag_args("prefill+decode", "torch", {}) == []


def test_up_refuses_modes_with_hops_vllm_does_not_run_yet() -> None:
    check_mode("vllm", "epd")
    check_mode("vllm", "e-pd")
    check_mode("torch", "e-p-d")
    for mode in ("e-p-d", "ep-d"):
        with pytest.raises(SystemExit, match="epd, e-pd"):
            check_mode("vllm", mode)


def test_engine_vllm_without_vllm_fails_at_start_naming_what_to_install(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *a: Any) -> Any:
        return None if name == "vllm" else real(name, *a)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    spec = resolve_model(str(tiny_model_dir), "tiny-qwen2-vl")
    settings = WorkerSettings(engine="vllm")
    with pytest.raises(SystemExit, match=r"pip install 'mmpipe\[vllm\]'.*deploy/install-vllm.sh"):
        build_stage("prefill+decode", PipelineConfig(), settings, spec)
    with pytest.raises(SystemExit, match="runs the roles encode\\+prefill\\+decode, prefill\\+decode"):
        build_stage("decode", PipelineConfig(), settings, spec)
