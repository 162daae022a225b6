"""A whole stack on a nats-server that requires credentials: every process
takes them from the MMPIPE_NATS_* environment."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.auth import NatsAuth
from pipeline.config import PipelineConfig
from pipeline.nats_server import NatsServer, NatsServerConfig
from stages.models import ModelSpec
from tests.e2e.conftest import N, ask, client, start_stack

USER = NatsAuth(user="mm", password="s3cret")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[NatsServer]:
    srv = NatsServer(NatsServerConfig(data_dir=tmp_path / "nats", port=0, auth=USER))
    srv.start()
    yield srv
    srv.stop()


@pytest.mark.e2e
async def test_a_whole_stack_takes_its_credentials_from_the_environment(
    server: NatsServer, model_spec: ModelSpec, reference: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var, value in USER.to_env().items():
        monkeypatch.setenv(var, value)
    stack, stop = await start_stack(PipelineConfig(nats_url=server.url, namespace="auth"), model_spec)
    try:
        async with client(stack) as c:
            assert await ask(c, "Say something.", stream=True) == (reference("Say something.", [])[1], N)
    finally:
        await stop()
