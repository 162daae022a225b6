"""``mmpipe up`` as a user runs it, in every mode: the embedded nats-server,
every worker as its own OS process, the bridge; the official openai client
gets exactly generate()'s tokens; then Ctrl-C stops all of it."""

from __future__ import annotations

import signal
import socket
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest

from schemas.routes import MODES
from tests.e2e.conftest import gradient, png_data_url
from tests.e2e.processes import Processes

N = 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ask(client: openai.OpenAI, content: Any, stream: bool) -> str:
    kw: dict[str, Any] = {"max_tokens": N, "temperature": 0, "extra_body": {"min_tokens": N}}
    messages: Any = [{"role": "user", "content": content}]
    if not stream:
        return (
            client.chat.completions.create(model="tiny-qwen2-vl", messages=messages, **kw).choices[0].message.content
            or ""
        )
    chunks = client.chat.completions.create(model="tiny-qwen2-vl", messages=messages, stream=True, **kw)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.mark.e2e
@pytest.mark.parametrize("mode", list(MODES))
def test_up_serves_every_mode_as_processes_and_stops_cleanly(
    mode: str, tmp_path: Path, mmpipe_home: Path, tiny_model_dir: Path, reference: Any
) -> None:
    port = _free_port()
    procs = Processes(tmp_path, mmpipe_home)
    hops = MODES[mode]
    # Two workers of the last role: scaling out is starting more of them.
    up = procs.start(
        "up", "--mode", mode, "--port", str(port), "--data-dir", str(tmp_path / "data"),
        "--workers", f"{hops[-1]}=2", "--transport", "nixl",
    )  # fmt: skip
    try:
        up.wait_for("mmpipe ready")
        children = psutil.Process(up.popen.pid).children(recursive=True)
        started = sorted(" ".join(c.cmdline()[3:5]) for c in children if "pipeline.cli" in c.cmdline())
        assert started == sorted(
            ["worker processor", *(f"worker {h}" for h in hops), f"worker {hops[-1]}", "bridge --nats-url"]
        )
        assert any("nats-server" in c.name() for c in children)

        one, two = gradient(64, 48, 1), gradient(40, 72, 5)
        single = [{"type": "image_url", "image_url": {"url": png_data_url(one)}}, {"type": "text", "text": "What?"}]
        pair = [
            {"type": "text", "text": "Compare"},
            {"type": "image_url", "image_url": {"url": png_data_url(one)}},
            {"type": "text", "text": "and"},
            {"type": "image_url", "image_url": {"url": png_data_url(two)}},
        ]
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0) as client:
            assert _ask(client, single, stream=True) == reference(single, [one], N)[1]
            assert _ask(client, pair, stream=False) == reference(pair, [one, two], N)[1]
            assert _ask(client, "Say something.", stream=True) == reference("Say something.", [], N)[1]
    finally:
        code = up.stop(signal.SIGINT)
        procs.stop_all()
    assert code == 0, up.text()[-3000:]
    assert all(not c.is_running() or c.status() == psutil.STATUS_ZOMBIE for c in children)
    assert "Traceback" not in up.text()
