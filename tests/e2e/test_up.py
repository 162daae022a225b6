"""``mmpipe up`` as a user runs it: the embedded nats-server, every worker of
the mode as its own OS process, the bridge; then Ctrl-C stops all of it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest

from tests.e2e.conftest import gradient, image_content, png_data_url


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.e2e
def test_up_in_e_p_d_mode_serves_the_openai_client_and_stops_cleanly(
    tmp_path: Path, mmpipe_home: Path, tiny_model_dir: Path, reference: Any
) -> None:
    port = _free_port()
    log = tmp_path / "up.log"
    cmd = [sys.executable, "-m", "pipeline.cli", "up", "--mode", "e-p-d", "--port", str(port)]
    cmd += ["--data-dir", str(tmp_path / "data"), "--workers", "decode=2", "--transport", "nixl"]
    env = {**os.environ, "MMPIPE_HOME": str(mmpipe_home)}
    with open(log, "wb") as out:
        up = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120
        while b"mmpipe ready" not in log.read_bytes():
            assert up.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        children = psutil.Process(up.pid).children(recursive=True)
        roles = sorted(" ".join(c.cmdline()[3:5]) for c in children if "pipeline.cli" in c.cmdline())
        assert roles == sorted(
            [
                "worker processor",
                "worker encode",
                "worker prefill",
                "worker decode",
                "worker decode",
                "bridge --nats-url",
            ]
        )
        assert any("nats-server" in c.name() for c in children)
        image = gradient(64, 48, 1)
        content = image_content(png_data_url(image))
        _, expected = reference(content, [image])
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        stream = client.chat.completions.create(
            model="tiny-qwen2-vl",
            messages=[{"role": "user", "content": content}],  # type: ignore[misc]
            max_tokens=12,
            temperature=0,
            stream=True,
            extra_body={"min_tokens": 12},
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected
        client.close()
    finally:
        up.send_signal(signal.SIGINT)
        code = up.wait(60)
    assert code == 0, log.read_text()[-3000:]
    assert all(not c.is_running() or c.status() == psutil.STATUS_ZOMBIE for c in children)
    assert "Traceback" not in log.read_text()
