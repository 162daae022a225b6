"""``--engine vllm`` as the CLI and ``build_stage`` take it, in any venv:
pass-through engine arguments, the modes and roles it serves, and a clear
start failure where vLLM is not installed (the vLLM runs themselves are
tests/vllm, in the vLLM venv)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from pipeline.cli import parser
from pipeline.config import PipelineConfig
from pipeline.launcher import check_mode, role_settings
from pipeline.serve import WorkerSettings, build_stage, runs_engine_process
from pipeline.settings import SettingError, load_kind
from pipeline.settings.kinds import UpSettings
from schemas.codec import encode
from schemas.processed import ProcessedRequest, VllmKv
from schemas.request import ChatMessage, GenerateRequest, SamplingParams
from stages.models import resolve_model
from stages.sglang_engine import disaggregation_of
from stages.torch_engine.settings import intra_op_threads, step_priority_s
from stages.vllm_engine.args import CPU_DEFAULTS, KvConnectorSettings, kv_transfer_config


def _worker(role: str, *flags: str) -> WorkerSettings:
    settings: WorkerSettings = load_kind("worker", parser().parse_args(["worker", role, *flags]), {}).settings.worker
    return settings


def test_engine_args_from_a_file_and_flags_json_values_and_dashes(tmp_path: Path) -> None:
    file = tmp_path / "args.json"
    file.write_text(json.dumps({"max-model-len": 1024, "dtype": "bfloat16"}))
    flags = ["--vllm-args-file", str(file), "--vllm-arg", "dtype=float32", "--vllm-arg", "enforce-eager=true"]
    flags += ["--vllm-arg", 'limit_mm_per_prompt={"image": 2}', "--vllm-arg", "x=a b"]
    # On a GPU: no host defaults under them (below).
    assert _worker("prefill+decode", "--device", "cuda", *flags).engine_args() == {
        "max_model_len": 1024,
        "dtype": "float32",  # the flag wins over the file
        "enforce_eager": True,
        "limit_mm_per_prompt": {"image": 2},
        "x": "a b",
    }
    with pytest.raises(SettingError, match="KEY=VALUE"):
        _worker("decode", "--vllm-arg", "no-value")
    file.write_text("[1]")
    with pytest.raises(ValueError, match="JSON object"):
        _worker("decode", "--vllm-args-file", str(file)).engine_args()


def test_up_gives_vllm_to_its_roles_only(tmp_path: Path) -> None:
    worker = _worker("prefill+decode", "--engine", "vllm", "--vllm-arg", "max_model_len=512", "--device", "cuda:1")
    assert (worker.engine, worker.engine_args()) == ("vllm", {"max_model_len": 512})
    assert _worker("encode").engine == "torch"
    up = UpSettings()
    for role in ("prefill+decode", "prefill", "decode", "encode+prefill", "encode+prefill+decode"):
        handed = role_settings(role, worker, up, tmp_path, 0)
        assert (handed.engine, handed.engine_args()) == ("vllm", {"max_model_len": 512}), role
    assert role_settings("encode", worker, up, tmp_path, 0).engine == "torch"
    assert role_settings("processor", worker, up, tmp_path, 0).engine == "torch"
    torch_worker = _worker("decode")
    assert role_settings("decode", torch_worker, up, tmp_path, 0).engine == "torch"


def test_vllm_on_a_cpu_gets_what_it_needs_to_start_unless_told_otherwise(tmp_path: Path) -> None:
    cpu = _worker("prefill+decode", "--engine", "vllm", "--device", "cpu").engine_args()
    assert cpu == CPU_DEFAULTS and cpu["skip_mm_profiling"] is True and cpu["dtype"] == "float32"
    file = tmp_path / "args.json"
    file.write_text(json.dumps({"block_size": 64}))
    given = ["--vllm-args-file", str(file), "--vllm-arg", "dtype=bfloat16"]
    assert _worker("decode", "--engine", "vllm", "--device", "cpu", *given).engine_args() == {
        **CPU_DEFAULTS,
        "block_size": 64,
        "dtype": "bfloat16",
    }
    assert _worker("decode", "--engine", "vllm", "--device", "cuda").engine_args() == {}


def test_up_takes_every_mode_with_vllm() -> None:
    for mode in ("epd", "e-pd", "e-p-d", "ep-d"):
        check_mode("vllm", mode)
        check_mode("torch", mode)


def test_sglang_runs_every_role_that_prefills_or_decodes(tmp_path: Path) -> None:
    for mode in ("epd", "e-pd", "e-p-d", "ep-d"):
        check_mode("sglang", mode)
    with pytest.raises(SystemExit, match="--vllm-encoder needs --engine vllm"):
        check_mode("sglang", "e-pd", vllm_encoder=True)
    worker = _worker("prefill+decode", "--engine", "sglang", "--sglang-arg", "context_length=512")
    assert worker.sglang_args == {"context_length": 512}
    up = UpSettings()
    for role in ("prefill+decode", "encode+prefill+decode", "encode+prefill", "prefill", "decode"):
        assert role_settings(role, worker, up, tmp_path, 0).engine == "sglang", role
    # SGLang's own PD disaggregation where prefill and decode are apart.
    assert [disaggregation_of(r) for r in ("encode+prefill+decode", "prefill+decode")] == [None, None]
    assert [disaggregation_of(r) for r in ("encode+prefill", "prefill", "decode")] == ["prefill", "prefill", "decode"]
    # mmpipe's own encode worker and processor beside it.
    assert role_settings("encode", worker, up, tmp_path, 0).engine == "torch"
    assert role_settings("processor", worker, up, tmp_path, 0).engine == "torch"


def test_engine_sglang_without_sglang_fails_at_start_naming_what_to_install(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "sglang", None)  # its import fails, installed or not
    spec = resolve_model(str(tiny_model_dir), "tiny-qwen2-vl")
    settings = WorkerSettings(engine="sglang")
    with pytest.raises(SystemExit, match=r"deploy/install-sglang.sh.*mmpipe\[sglang\]"):
        build_stage("prefill+decode", PipelineConfig(), settings, spec)
    with pytest.raises(SystemExit, match=r"--engine sglang runs the roles encode\+prefill\+decode, .*, not encode"):
        build_stage("encode", PipelineConfig(), settings, spec)


def test_kv_connector_settings_reach_the_prefill_and_decode_roles(tmp_path: Path) -> None:
    assert _worker("decode", "--vllm-kv-connector", "nixl", "--vllm-kv-port", "7").vllm_kv == KvConnectorSettings(
        "nixl", "", 7
    )
    assert _worker("decode").vllm_kv.connector == "example"
    # mmpipe up: one folder for the deployment, a free side-channel port for each worker.
    worker = _worker("decode", "--engine", "vllm", "--vllm-kv-port", "7", "--vllm-storage-ttl", "0")
    for role in ("prefill", "encode+prefill", "decode"):
        handed = role_settings(role, worker, UpSettings(), tmp_path, 0)
        assert handed.vllm_kv == KvConnectorSettings("example", str(tmp_path / "vllm-kv"), 0), role
        assert handed.vllm_storage_ttl_s == 0.0
    assert _worker("prefill").vllm_storage_ttl_s == 600.0
    kv = KvConnectorSettings("example", str(tmp_path / "kv"))
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
    with pytest.raises(SystemExit, match=r"pip install -e '\.\[vllm\]'.*deploy/install-vllm.sh"):
        build_stage("prefill+decode", PipelineConfig(), settings, spec)
    with pytest.raises(SystemExit, match=r"pip install -e '\.\[vllm\]'"):
        build_stage("decode", PipelineConfig(), settings, spec)


@pytest.mark.parametrize(
    ("flags", "device", "expected"),
    [
        ((), "cuda:0", 0.0),
        ((), "cpu", None),
        (("--step-priority-ms", "-1"), "cuda", None),
        (("--step-priority-ms", "20"), "cpu", 0.02),
    ],
)
def test_decode_steps_go_first_on_a_gpu_unless_told(
    flags: tuple[str, ...], device: str, expected: float | None
) -> None:
    settings = _worker("encode+prefill+decode", *flags)
    assert step_priority_s(settings.decode.step_priority_ms, device) == expected


@pytest.mark.parametrize(
    ("flags", "device", "expected"),
    [((), "cuda:0", 1), ((), "cpu", None), (("--torch-threads", "3"), "cuda", 3), (("--torch-threads", "2"), "cpu", 2)],
)
def test_torch_keeps_one_cpu_thread_on_a_gpu_worker_unless_told(
    flags: tuple[str, ...], device: str, expected: int | None
) -> None:
    settings = _worker("encode+prefill+decode", *flags)
    assert intra_op_threads(settings.torch_threads, device) == expected


def test_a_torch_worker_applies_its_thread_count(tiny_model_dir: Path) -> None:
    import torch

    before = torch.get_num_threads()
    want = 1 if before != 1 else 2
    try:
        settings = _worker("encode+prefill+decode", "--device", "cpu", "--torch-threads", str(want))
        build_stage("encode+prefill+decode", PipelineConfig(), settings, resolve_model(str(tiny_model_dir), "tiny"))
        assert torch.get_num_threads() == want
    finally:
        torch.set_num_threads(before)
    with pytest.raises(SettingError, match="torch-threads"):
        _worker("decode", "--torch-threads", "0")


def test_the_engine_core_runs_apart_by_default_only_where_it_can_on_a_gpu() -> None:
    """Unset, a GPU's aggregated role runs its engine core in a process of
    its own; a split role (its tensors handed on), a CPU, another engine, or
    media decoded by the processor keep it in the worker. Said either way,
    the flag wins."""
    epd = "encode+prefill+decode"
    assert runs_engine_process(epd, _worker(epd, "--device", "cuda"))
    assert runs_engine_process(epd, _worker(epd, "--device", "cuda:1"))
    assert not runs_engine_process(epd, _worker(epd, "--device", "cpu"))
    for role in ("encode", "prefill+decode", "encode+prefill", "prefill", "decode"):
        assert not runs_engine_process(role, _worker(role, "--device", "cuda")), role
    assert not runs_engine_process(epd, _worker(epd, "--device", "cuda", "--engine", "vllm"))
    assert not runs_engine_process(epd, _worker(epd, "--device", "cuda", "--frontend-decode"))
    assert not runs_engine_process(epd, _worker(epd, "--device", "cuda", "--no-engine-process"))
    assert runs_engine_process(epd, _worker(epd, "--device", "cpu", "--engine-process"))
