"""Each test that needs NATS gets its own nats-server: port 0, a temp store.

``--engine-device`` (env ``MMPIPE_TEST_DEVICE``; default cpu, as in CI) is
where the engine equality tests in tests/stages run both the engine and the
transformers reference: ``cuda`` runs them on the GPU paths (the batch
decoder's CUDA graphs, the compiled fused step) in float32, TF32 off.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.config import PipelineConfig
from pipeline.connection import connect
from pipeline.nats_server import NatsServer, NatsServerConfig

ENGINE_DEVICE_HELP = (
    "device of the engine equality tests (tests/stages) and of their transformers reference: "
    "cpu (default, CI) or cuda[:N]; env MMPIPE_TEST_DEVICE"
)


TF32_ADVICE = "TensorFloat32 tensor cores for float32 matrix multiplication available but not enabled"


def pytest_addoption(parser: pytest.Parser) -> None:
    default = os.environ.get("MMPIPE_TEST_DEVICE") or "cpu"
    parser.addoption("--engine-device", default=default, help=ENGINE_DEVICE_HELP)


def pytest_configure(config: pytest.Config) -> None:
    device = str(config.getoption("--engine-device"))
    if device == "cpu":
        return  # CI: nothing imported, nothing set
    if device != "cuda" and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise pytest.UsageError(f"--engine-device {device!r}: cpu, cuda or cuda:N")
    import torch

    if not torch.cuda.is_available():
        build = "" if torch.version.cuda else " (a build without CUDA)"
        raise pytest.UsageError(
            f"--engine-device {device}: torch {torch.__version__}{build} sees no CUDA device; "
            "run it on a GPU machine or leave the option out"
        )
    index = torch.device(device).index
    if index is not None:
        if index >= torch.cuda.device_count():
            raise pytest.UsageError(f"--engine-device {device}: only {torch.cuda.device_count()} CUDA device(s)")
        torch.cuda.set_device(index)  # the decoder's graphs and streams are the current device's
    _exact_float32(torch)
    # Inductor's advice when it compiles a float32 matmul with TF32 off (the
    # fused step): turned off on purpose here, not an error of the test.
    config.addinivalue_line("filterwarnings", f"ignore:{TF32_ADVICE}:UserWarning")


def pytest_report_header(config: pytest.Config) -> str | None:
    device = str(config.getoption("--engine-device"))
    if device == "cpu":
        return None
    import torch

    return (
        f"engine device: {device} ({torch.cuda.get_device_name(device)}), torch {torch.__version__}, "
        f"matmul fp32 {_fp32_precision(torch)}"
    )


def _fp32_precision(torch: Any) -> str:
    if hasattr(torch.backends.cudnn, "fp32_precision"):
        return f"{torch.backends.cuda.matmul.fp32_precision}, cuDNN fp32 {torch.backends.cudnn.conv.fp32_precision}"
    return f"tf32={torch.backends.cuda.matmul.allow_tf32}, cuDNN tf32={torch.backends.cudnn.allow_tf32}"


def _exact_float32(torch: Any) -> None:
    """Float32 matmuls and convolutions without TF32, for the engine and the
    reference alike (the engine sets none; torch's default leaves cuDNN's
    convolutions, the Qwen patch embedding among them, in TF32). Through
    the fp32_precision API where torch has it: mixing it with the legacy
    allow_tf32 flags makes torch raise on a later read."""
    if hasattr(torch.backends.cudnn, "fp32_precision"):
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        torch.backends.cudnn.fp32_precision = "ieee"
    else:  # torch < 2.9
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


@pytest.fixture(scope="session")
def engine_device(request: pytest.FixtureRequest) -> str:
    """Where the engine equality tests build their engines and reference
    models ("cpu" unless --engine-device says otherwise)."""
    return str(request.config.getoption("--engine-device"))


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    server = NatsServer(NatsServerConfig(data_dir=tmp_path / "nats", port=0))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def namespace() -> str:
    # Unique per test, so subjects never collide even on a shared server.
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def pipeline_config(nats_server: NatsServer, namespace: str) -> PipelineConfig:
    return PipelineConfig(nats_url=nats_server.url, namespace=namespace)


@pytest.fixture
async def nats_client(nats_server: NatsServer) -> AsyncIterator[tuple[object, object]]:
    nc, js = await connect(nats_server.url, name="test")
    yield nc, js
    await nc.close()


@pytest.fixture(scope="session", autouse=True)
def mmpipe_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Built-in models and caches go to a temp dir, never the user's home."""
    home = tmp_path_factory.mktemp("mmpipe-home")
    old = os.environ.get("MMPIPE_HOME")
    os.environ["MMPIPE_HOME"] = str(home)
    yield home
    if old is None:
        del os.environ["MMPIPE_HOME"]
    else:
        os.environ["MMPIPE_HOME"] = old


@pytest.fixture(scope="session")
def tiny_model_dir(mmpipe_home: Path) -> Path:
    from stages.models import builtin_path

    return builtin_path("tiny-qwen2-vl")
