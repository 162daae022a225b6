"""``mmpipe bench transport``: tensor transfer GB/s between two OS processes,
next to an in-process memcpy of the same bytes.

Why it is built this way:

- Two processes, as two workers are: this process holds (``put``), a child
  (``python -m pipeline.bench.transport --peer ...``) reads (``get``), so
  NIXL really goes through UCX between address spaces and the NATS object
  store really goes through the server. The child answers on stdout with
  lines starting ``@@`` (a library's stray line is not an answer), as the
  transport tests' peer does.
- The reader's ``get`` is what a worker waits for before it can compute, so
  that is what is timed, in the child, around the call: lease round trip,
  the transfer itself and the copy into a fresh tensor. ``put`` is shown
  beside it: for NATS the bytes also travel holder → server at put time.
- One warm-up transfer per size, not counted (the first NIXL read also
  connects to the holder); then the median and the best of ``repeats``.
- A transfer rate alone says little about a machine; the ratio to a plain
  ``dst.copy_(src)`` of the same bytes on preallocated tensors, measured in
  the same run, says how close the transport gets to what memory can do.
- A small strided checksum of what the reader got is compared with the
  source, outside the timing, so a fast transfer of wrong bytes is an error.
- ``--device cuda``: both processes hold and read VRAM of the same GPU
  (UCX's CUDA IPC), and the yardstick is a device-to-device copy of the same
  bytes on that GPU, timed to completion. NIXL's READ alone (without the
  lease round trip and the copy out of the receive arena) is shown beside
  the whole ``get``: the READ is the transfer, the rest is mmpipe's cost.
- ``--reader-device cuda:1``: the reader on another GPU than the holder
  (UCX's CUDA IPC over NVLink, as a prefill and a decode worker on two GPUs
  are); the yardstick is then a ``copy_`` from the holder's GPU to the
  reader's.
- ``into``: the same bytes by ``get_into`` a tensor the reader allocated
  once (what the decode worker does with its KV cache's slot): no receive
  arena and no copy after the READ; what remains is the lease round trip.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec
import torch

from pipeline.transport.packing import align_up

ANSWER = "@@"
SAMPLE_STRIDE = 4093
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def parse_size(text: str) -> int:
    """``2MB`` (decimal, like GB/s), ``2MiB`` (binary) or a plain byte count."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"size {text!r} is not a number with KB/MB/GB or KiB/MiB/GiB")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n < 1:
        raise ValueError(f"size {text!r} is empty")
    return n


def format_size(n: int) -> str:
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def checksum(t: torch.Tensor) -> int:
    return int(t.reshape(-1)[::SAMPLE_STRIDE].to(torch.int64).sum())


# -- the reader, in the child process ------------------------------------------


async def peer(
    url: str, namespace: str, kind: str, budget: int, device: str = "cpu", progress_thread: bool = False
) -> None:
    """Reads refs given on stdin and answers ``@@ got <seconds> <nbytes> <checksum> <read seconds>``
    (the READ alone: NIXL's, else the whole get)."""
    from pipeline.connection import connect
    from pipeline.transport import TransportSettings, open_transport
    from schemas.tensors import TensorRef

    def answer(*parts: object) -> None:
        print(ANSWER, *parts, flush=True)

    nc, js = await connect(url, name="bench-reader")
    settings = TransportSettings(budget_bytes=budget, progress_thread=progress_thread)
    transport = await open_transport(kind, nc, js, namespace, settings, "bench-reader", device)
    answer("ready", transport.name)
    targets: dict[int, torch.Tensor] = {}
    loop = asyncio.get_running_loop()
    try:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            cmd = json.loads(line)
            if cmd["op"] == "exit":
                break
            ref = msgspec.convert(cmd["ref"], TensorRef)
            t0 = time.perf_counter()
            try:
                if cmd.get("into"):
                    # Preallocated once per size, as a decoder's KV cache is.
                    size = ref.tensors[0].shape[0]
                    if size not in targets:
                        targets[size] = torch.empty(size, dtype=torch.uint8, device=device)
                    target = targets[size]
                    await transport.get_into(ref, [target])
                    got = [target]
                else:
                    got = await transport.get(ref, device)
            except Exception as exc:
                answer("error", type(exc).__name__, str(exc).replace("\n", " "))
                continue
            dt = time.perf_counter() - t0
            read_s = getattr(transport, "last_read", (0, dt))[1] or dt
            phases = json.dumps(getattr(transport, "last_read_phases", {}), separators=(",", ":"))
            answer("got", repr(dt), sum(t.numel() for t in got), checksum(got[0]), repr(read_s), phases)
    finally:
        await transport.close()
        await nc.close()


class Reader:
    """The child process, from the holder's side."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def spawn(
        cls,
        url: str,
        namespace: str,
        kind: str,
        budget: int,
        log_level: str = "ERROR",
        device: str = "cpu",
        progress_thread: bool = False,
    ) -> Reader:
        env = {**os.environ}
        env.setdefault("NIXL_LOG_LEVEL", "WARN")
        proc = await asyncio.create_subprocess_exec(
            *[sys.executable, "-m", "pipeline.bench.transport", "--peer", "--url", url, "--namespace", namespace],
            *["--transport", kind, "--budget", str(budget), "--log-level", log_level, "--device", device],
            *(["--progress-thread"] if progress_thread else []),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
        )
        reader = cls(proc)
        kind_, name = await reader.answer(timeout_s=120)
        if kind_ != "ready" or name != kind:
            raise RuntimeError(f"the reader process started {kind_} {name}, not a {kind} transport")
        return reader

    async def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd).encode() + b"\n")
        await self.proc.stdin.drain()

    async def answer(self, timeout_s: float = 60) -> list[str]:
        assert self.proc.stdout is not None
        async with asyncio.timeout(timeout_s):
            while True:
                line = (await self.proc.stdout.readline()).decode()
                if not line:
                    raise RuntimeError(f"the reader process exited with {await self.proc.wait()}")
                if line.startswith(ANSWER):
                    return line.split(maxsplit=1)[1].split(maxsplit=5)

    async def get(self, ref: Any, into: bool = False) -> tuple[float, int, int, float, dict[str, float]]:
        """(seconds of the get, bytes, checksum, seconds of the READ alone, the READ's phases);
        ``into``: ``get_into`` a tensor the reader holds already."""
        await self.send(op="get", ref=msgspec.to_builtins(ref), into=into)
        got = await self.answer()
        if got[0] != "got":
            raise RuntimeError(f"the reader failed: {' '.join(got[1:])}")
        return float(got[1]), int(got[2]), int(got[3]), float(got[4]), json.loads(got[5])

    async def close(self) -> None:
        if self.proc.returncode is None:
            try:
                await self.send(op="exit")
                async with asyncio.timeout(20):
                    await self.proc.wait()
            except (TimeoutError, ConnectionError):
                self.proc.kill()
                await self.proc.wait()


# -- the holder, in this process -----------------------------------------------


def memcpy_seconds(src: torch.Tensor, repeats: int, to: torch.device | None = None) -> list[float]:
    """``dst.copy_(src)`` on preallocated tensors (``dst`` on ``to``, else
    beside ``src``), after one warm-up copy; on a GPU timed until the copy
    has finished on both devices (device to device)."""
    dst = torch.empty_like(src, device=to or src.device)
    dst.copy_(src)
    gpus = {d for d in (src.device, dst.device) if d.type == "cuda"}

    def sync() -> None:
        for gpu in gpus:
            torch.cuda.synchronize(gpu)

    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        times.append(time.perf_counter() - t0)
    return times


def row_summary(
    kind: str,
    nbytes: int,
    gets: list[float],
    puts: list[float],
    copies: list[float],
    reads: list[float] | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    get_p50, copy_p50 = statistics.median(gets), statistics.median(copies)
    read_p50 = statistics.median(reads or gets)
    gbps = nbytes / get_p50 / 1e9
    memcpy_gbps = nbytes / copy_p50 / 1e9
    return {
        "device": device,
        "read_p50_ms": read_p50 * 1000,
        "read_gbps_p50": nbytes / read_p50 / 1e9,
        "read_ratio": nbytes / read_p50 / 1e9 / memcpy_gbps,
        "transport": kind,
        "bytes": nbytes,
        "repeats": len(gets),
        "get_p50_ms": get_p50 * 1000,
        "get_best_ms": min(gets) * 1000,
        "put_p50_ms": statistics.median(puts) * 1000,
        "gbps_p50": gbps,
        "gbps_best": nbytes / min(gets) / 1e9,
        "memcpy_gbps": memcpy_gbps,
        "ratio": gbps / memcpy_gbps,
    }


async def bench_kind(
    url: str,
    kind: str,
    sizes: list[int],
    repeats: int,
    log_level: str = "ERROR",
    device: str = "cpu",
    progress_thread: bool = False,
    reader_device: str | None = None,
) -> list[dict[str, Any]]:
    from pipeline.connection import connect
    from pipeline.transport import TransportSettings, open_transport

    namespace = f"bench{uuid.uuid4().hex[:10]}"
    # Room for two transfers in flight: the next put need not wait for the last free.
    budget = 2 * align_up(max(sizes), 1 << 20) + (1 << 20)
    nc, js = await connect(url, name="bench-holder")
    rows: list[dict[str, Any]] = []
    try:
        settings = TransportSettings(budget_bytes=budget, progress_thread=progress_thread)
        holder = await open_transport(kind, nc, js, namespace, settings, "bench-holder", device)
        reader: Reader | None = None
        try:
            reader_on = reader_device or device
            reader = await Reader.spawn(url, namespace, kind, budget, log_level, reader_on, progress_thread)
            g = torch.Generator().manual_seed(0)
            for size in sizes:
                src = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g).to(device)
                want = checksum(src)
                gets: list[float] = []
                puts: list[float] = []
                reads: list[float] = []
                phases: dict[str, list[float]] = {}
                for i in range(repeats + 1):  # the first is the warm-up
                    t0 = time.perf_counter()
                    ref = await holder.put([src], owner=f"bench-{size}-{i}")
                    put_s = time.perf_counter() - t0
                    get_s, got_bytes, got_sum, read_s, read_phases = await reader.get(ref)
                    if got_bytes != size or got_sum != want:
                        raise RuntimeError(f"{kind}: the reader got {got_bytes} bytes with the wrong checksum")
                    if i:
                        gets.append(get_s)
                        puts.append(put_s)
                        reads.append(read_s)
                        for name, value in read_phases.items():
                            phases.setdefault(name, []).append(value)
                intos: list[float] = []
                for i in range(repeats + 1):
                    ref = await holder.put([src], owner=f"bench-into-{size}-{i}")
                    into_s, got_bytes, got_sum, _, _ = await reader.get(ref, into=True)
                    if got_bytes != size or got_sum != want:
                        raise RuntimeError(f"{kind}: get_into wrote {got_bytes} bytes with the wrong checksum")
                    if i:
                        intos.append(into_s)
                copies = memcpy_seconds(src, repeats, torch.device(reader_on))
                row = row_summary(kind, size, gets, puts, copies, reads, device)
                row["reader_device"] = reader_on
                row["read_phases_p50_ms"] = {k: statistics.median(v) * 1000 for k, v in phases.items()}
                row["into_p50_ms"] = statistics.median(intos) * 1000
                row["into_ratio"] = statistics.median(copies) / statistics.median(intos)
                rows.append(row)
        finally:
            if reader is not None:
                await reader.close()
            await holder.close()
    finally:
        await nc.close()
    return rows


async def bench_transports(
    kinds: list[str],
    sizes: list[int],
    repeats: int,
    nats_url: str | None = None,
    log_level: str = "ERROR",
    device: str = "cpu",
    progress_thread: bool = False,
    reader_device: str | None = None,
) -> list[dict[str, Any]]:
    """Every transport of ``kinds`` at every size; a nats-server of its own unless ``nats_url``."""
    from pipeline.nats_server import NatsServer, NatsServerConfig

    with tempfile.TemporaryDirectory(prefix="mmpipe-bench-") as tmp:
        server = None
        if nats_url is None:
            # Chunked object-store uploads; max_payload does not bound the tensor size.
            server = NatsServer(NatsServerConfig(data_dir=Path(tmp) / "nats", port=0))
            nats_url = server.start()
        try:
            rows: list[dict[str, Any]] = []
            for kind in kinds:
                rows += await bench_kind(
                    nats_url, kind, sizes, repeats, log_level, device, progress_thread, reader_device
                )
            return rows
        finally:
            if server is not None:
                server.stop()


def format_rows(rows: list[dict[str, Any]]) -> str:
    threads = torch.get_num_threads()
    device = rows[0].get("device", "cpu")
    where = f"on {torch.cuda.get_device_name(device)}, VRAM" if device.startswith("cuda") else f"{threads} threads"
    if rows[0].get("reader_device", device) != device:
        where += f", holder on {device}, reader on {rows[0]['reader_device']}"
    head = (
        f"mmpipe bench transport  holder and reader in two processes; torch {torch.__version__} "
        f"({where}{', UCX progress thread' if rows[0].get('progress_thread') else ''}); "
        f"median and best of {rows[0]['repeats']} after 1 warm-up; GB = 10^9 B"
    )
    cols = ["transport", "size", "get p50 ms", "get best ms", "GB/s p50", "GB/s best", "put p50 ms"]
    cols += ["memcpy GB/s", "ratio", "READ p50 ms", "READ ratio", "into p50 ms", "into ratio"]
    table = [cols]
    for r in rows:
        table.append(
            [
                r["transport"],
                format_size(r["bytes"]),
                f"{r['get_p50_ms']:.3f}",
                f"{r['get_best_ms']:.3f}",
                f"{r['gbps_p50']:.2f}",
                f"{r['gbps_best']:.2f}",
                f"{r['put_p50_ms']:.3f}",
                f"{r['memcpy_gbps']:.2f}",
                f"{r['ratio']:.3f}",
                f"{r['read_p50_ms']:.3f}",
                f"{r['read_ratio']:.3f}",
                f"{r['into_p50_ms']:.3f}",
                f"{r['into_ratio']:.3f}",
            ]
        )
    widths = [max(len(line[i]) for line in table) for i in range(len(cols))]
    lines = [head, ""]
    for line in table:
        cells = [c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True))]
        lines.append("  ".join(cells))
    lines += ["", "ratio = GB/s p50 of the transfer / GB/s of dst.copy_(src) on the same bytes in this process"]
    lines += ["(dst on the reader's device)"] if rows[0].get("reader_device", device) != device else []
    lines += ["READ = NIXL's one-sided READ alone (the nats transport: the whole get)"]
    lines += ["into = get_into a tensor the reader holds (a KV cache's slot): lease and READ, no receive arena"]
    for r in rows:
        if r.get("read_phases_p50_ms"):
            parts = "  ".join(f"{k} {v:.3f}" for k, v in r["read_phases_p50_ms"].items())
            lines.append(f"READ phases p50 ms, {r['transport']} {format_size(r['bytes'])}: {parts}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from pipeline.bench import run_async

    try:
        sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError as exc:
        raise SystemExit(f"--sizes: {exc}") from None
    kinds = [k.strip() for k in args.transports.split(",") if k.strip()]
    if not sizes or not kinds or any(k not in ("nixl", "nats") for k in kinds) or args.repeats < 1:
        raise SystemExit("mmpipe bench transport: --sizes, --transports (nixl, nats) and --repeats >= 1 are needed")
    device = getattr(args, "device", "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("mmpipe bench transport --device cuda: no CUDA device here")
    progress = bool(getattr(args, "progress_thread", False))
    reader_device = getattr(args, "reader_device", None)
    if reader_device and reader_device.startswith("cuda") != device.startswith("cuda"):
        raise SystemExit("mmpipe bench transport: --reader-device must be of --device's kind (cpu, or cuda:N)")
    if reader_device and reader_device.startswith("cuda"):
        index = torch.device(reader_device).index or 0
        if index >= torch.cuda.device_count():
            raise SystemExit(f"mmpipe bench transport --reader-device {reader_device}: no such CUDA device here")
    rows = run_async(
        bench_transports(kinds, sizes, args.repeats, args.nats_url, args.log_level, device, progress, reader_device)
    )
    for row in rows:
        row["progress_thread"] = progress
    print(json.dumps(rows, indent=2) if args.json else format_rows(rows), flush=True)
    return 0


def _peer_main() -> None:
    from pipeline import logging as mm_logging

    p = argparse.ArgumentParser(prog="python -m pipeline.bench.transport")
    p.add_argument("--peer", action="store_true", required=True)
    p.add_argument("--url", required=True)
    p.add_argument("--namespace", required=True)
    p.add_argument("--transport", required=True)
    p.add_argument("--budget", type=int, required=True)
    p.add_argument("--log-level", default="ERROR")
    p.add_argument("--device", default="cpu")
    p.add_argument("--progress-thread", action="store_true")
    args = p.parse_args()
    mm_logging.configure(args.log_level)
    from pipeline.bench import run_async

    run_async(peer(args.url, args.namespace, args.transport, args.budget, args.device, args.progress_thread))


if __name__ == "__main__":
    _peer_main()
