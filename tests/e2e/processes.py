"""Workers as OS processes, as a deployment runs them: started with the CLI,
watched through their logs, stopped with a signal or killed outright."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path


class Proc:
    def __init__(self, args: list[str], log: Path, env: dict[str, str]) -> None:
        self.log = log
        with open(log, "wb") as out:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "pipeline.cli", *args], stdout=out, stderr=subprocess.STDOUT, env=env
            )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, needle: str, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while needle not in self.text():
            assert self.popen.poll() is None, f"exited with {self.popen.returncode}:\n{self.text()[-3000:]}"
            assert time.monotonic() < deadline, f"no {needle!r} within {timeout_s}s:\n{self.text()[-3000:]}"
            time.sleep(0.1)

    def up_ready(self, timeout_s: float = 300.0) -> tuple[str, dict[str, str]]:
        """``mmpipe up`` ready: its embedded nats-server's URL and each worker
        role's /metrics URL (its health beside it), as its log tells them."""
        self.wait_for("mmpipe ready", timeout_s=timeout_s)
        text = self.text()
        nats_url = re.search(r"nats=(\S+)", text)
        assert nats_url is not None, text[-3000:]
        metrics = {}
        for line in text.splitlines():
            if '"worker_health_port"' in line:
                event = json.loads(line[line.index("{") :])
                metrics[event["role"]] = event["metrics"]
        return nats_url.group(1), metrics

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
        return self.popen.wait(timeout_s)

    def kill(self) -> None:
        self.popen.kill()
        self.popen.wait()


class Processes:
    """Processes of one test, all stopped at its end."""

    def __init__(self, tmp: Path, home: Path) -> None:
        self.tmp = tmp
        self.env = {**os.environ, "MMPIPE_HOME": str(home)}
        self.procs: list[Proc] = []

    def start(self, *args: str) -> Proc:
        proc = Proc(list(args), self.tmp / f"{len(self.procs)}-{'-'.join(args[:2])}.log", self.env)
        self.procs.append(proc)
        return proc

    def worker(self, role: str, nats_url: str, mode: str, model_dir: Path, *more: str) -> Proc:
        return self.start(
            "worker", role, "--mode", mode, "--nats-url", nats_url, "--model", str(model_dir),
            "--served-model-name", "tiny-qwen2-vl", "--transport", "nixl", *more,
        )  # fmt: skip

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.popen.poll() is None:
                proc.stop()
