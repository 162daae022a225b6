"""``--engine vllm`` as the CLI and ``build_stage`` take it, in any venv:
pass-through engine arguments, the modes and roles it serves, and a clear
start failure where vLLM is not installed (the vLLM runs themselves are
tests/vllm, in the vLLM venv)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from pipeline.cli import parser
from pipeline.config import PipelineConfig
from pipeline.engine_flags import check_mode, engine_flag_args, vllm_args, vllm_kv_settings
from pipeline.serve import WorkerSettings, build_stage
from schemas.codec import encode
from schemas.processed import ProcessedRequest, VllmKv
from schemas.request import ChatMessage, GenerateRequest, SamplingParams
from stages.models import resolve_model
from stages.vllm_engine.args import KvConnectorSettings, engine_args, kv_transfer_config


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


def test_up_takes_every_mode_with_vllm() -> None:
    for mode in ("epd", "e-pd", "e-p-d", "ep-d"):
        check_mode("vllm", mode)
        check_mode("torch", mode)


def test_kv_connector_flags_reach_the_prefill_and_decode_roles_as_producer_and_consumer(tmp_path: Path) -> None:
    args = parser().parse_args(["worker", "decode", "--engine", "vllm", "--vllm-kv-connector", "nixl"])
    assert vllm_kv_settings(args) == KvConnectorSettings("nixl", "", 0)
    assert parser().parse_args(["worker", "decode"]).vllm_kv_connector == "example"
    kv = KvConnectorSettings("example", str(tmp_path / "kv"))
    for role in ("prefill", "encode+prefill", "decode"):
        forwarded = engine_flag_args(role, "vllm", {}, kv)
        assert forwarded[-4:] == ["--vllm-kv-connector", "example", "--vllm-kv-path", str(tmp_path / "kv")]
        assert vllm_kv_settings(parser().parse_args(["worker", role, *forwarded])) == kv
    assert "--vllm-kv-connector" not in engine_flag_args("prefill+decode", "vllm", {}, kv)
    # --vllm-storage-ttl reaches the workers (the default is theirs too).
    assert parser().parse_args(["worker", "prefill"]).vllm_storage_ttl == 600.0
    forwarded = engine_flag_args("prefill", "vllm", {}, kv, storage_ttl_s=0.0)
    assert parser().parse_args(["worker", "prefill", *forwarded]).vllm_storage_ttl == 0.0
    assert "--vllm-storage-ttl" not in engine_flag_args("prefill", "vllm", {}, kv)
    assert kv_transfer_config("prefill", kv) == {
        "kv_role": "kv_producer",
        "kv_connector": "ExampleConnector",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "kv")},
    }
    consumer = kv_transfer_config("decode", KvConnectorSettings("nixl"))
    assert consumer == {
        "kv_role": "kv_consumer",
        "kv_connector": "NixlConnector",
        "kv_load_failure_policy": "recompute",
    }
    assert kv_transfer_config("prefill+decode", kv) is None
    with pytest.raises(ValueError, match="--vllm-kv-connector 'other'"):
        kv_transfer_config("decode", KvConnectorSettings("other"))


def test_vllm_kv_rides_in_the_decode_message_and_a_restart_drops_it() -> None:
    request = GenerateRequest("r1", "m", [ChatMessage("user", "hi")], SamplingParams(max_tokens=4))
    base = ProcessedRequest(request, [1, 2], [], ["prefill", "decode"], 4, 0)
    assert b"vllm_kv" not in encode(base)  # omitted when unset
    params = {"remote_block_ids": [[1, 2]], "remote_host": "10.0.0.1", "do_remote_prefill": True}
    handed = ProcessedRequest(request, [1, 2], [], ["prefill", "decode"], 4, 0, hop_index=1, vllm_kv=VllmKv(params, 3))
    decoded = msgspec.msgpack.decode(encode(handed), type=ProcessedRequest)
    assert decoded.vllm_kv == VllmKv(params, 3)
    assert decoded.restarted().vllm_kv is None


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
    with pytest.raises(SystemExit, match=r"pip install 'mmpipe\[vllm\]'"):
        build_stage("decode", PipelineConfig(), settings, spec)
