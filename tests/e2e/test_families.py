"""Every family's built-in model through the bridge with the official openai
client, aggregated and fully disaggregated: exactly generate()'s text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pipeline.config import PipelineConfig
from stages.models import builtin_path, resolve_model
from tests.e2e.conftest import N, ask, client, gradient, make_reference, png_data_url, start_stack


@pytest.fixture(scope="module", params=["tiny-qwen2.5-vl", "tiny-llava"])
def family_model(request: pytest.FixtureRequest, mmpipe_home: Path) -> tuple[str, Any]:
    return request.param, make_reference(builtin_path(request.param))


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["epd", "e-p-d"])
async def test_family_equals_generate(pipeline_config: PipelineConfig, family_model: Any, mode: str) -> None:
    name, reference = family_model
    config = PipelineConfig(nats_url=pipeline_config.nats_url, namespace=pipeline_config.namespace, mode=mode)
    stack, stop = await start_stack(config, resolve_model(name))
    try:
        one, two = gradient(64, 48, 1), gradient(40, 72, 5)
        pair = [
            {"type": "image_url", "image_url": {"url": png_data_url(one)}},
            {"type": "text", "text": "and"},
            {"type": "image_url", "image_url": {"url": png_data_url(two)}},
        ]
        async with client(stack) as c:
            assert await ask(c, pair, stream=True, model=name) == (reference(pair, [one, two])[1], N)
            assert await ask(c, "Say something.", stream=False, model=name) == (reference("Say something.", [])[1], N)
    finally:
        await stop()
