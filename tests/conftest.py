"""Each test that needs NATS gets its own nats-server: port 0, a temp store."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from pipeline.config import PipelineConfig
from pipeline.connection import connect
from pipeline.nats_server import NatsServer, NatsServerConfig


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
