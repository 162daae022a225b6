"""A second OS process for the tensor transport tests: it holds or reads
tensors on command, as another worker would.

Run as ``python -m tests.pipeline.transport_peer --url U --namespace NS
--transport nixl|nats``. Commands arrive as JSON lines on stdin; answers go
to stdout as lines starting with ``@@`` (anything else on stdout, e.g. a
library's log line, is not an answer):

    {"op": "put", "seed": 1}      -> @@ ref <TensorRef as JSON>
    {"op": "get", "ref": {...}}   -> @@ got <digests as JSON> | @@ error <class> <message>
    {"op": "held"}                -> @@ held <bytes>
    {"op": "exit"}                -> closes and exits
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys

import msgspec
import torch

ANSWER = "@@"


def make_tensors(seed: int) -> list[torch.Tensor]:
    """Mixed dtypes and shapes, the same for a given seed in every process."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(3, 5, 7, generator=g),
        torch.randn(129, 64, generator=g).to(torch.bfloat16),
        torch.randint(-(2**62), 2**62, (33,), generator=g, dtype=torch.int64),
        torch.randn((), generator=g),
        torch.randn(2, 3, generator=g).to(torch.float16).t(),  # not contiguous
        torch.zeros(0, 4),
        torch.randn(1000, generator=g).to(torch.float64),
        # A KV hand-off: keys and values of 3 layers, [blocks, kv_heads, block_size, head_dim], bf16.
        *(torch.randn(3, 2, 16, 64, generator=g).to(torch.bfloat16) for _ in range(6)),
    ]


def digests(tensors: list[torch.Tensor]) -> list[list[object]]:
    """dtype, shape and a hash of the exact bytes of each tensor."""
    out: list[list[object]] = []
    for t in tensors:
        data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        out.append([str(t.dtype), list(t.shape), hashlib.sha256(data).hexdigest()])
    return out


async def main() -> None:
    from pipeline.connection import connect
    from pipeline.transport import TransportSettings, open_transport
    from schemas.tensors import TensorRef

    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--transport", required=True)
    parser.add_argument("--budget", type=int, default=8 << 20)
    args = parser.parse_args()

    def answer(*parts: str) -> None:
        print(ANSWER, *parts, flush=True)

    nc, js = await connect(args.url, name="transport-peer")
    settings = TransportSettings(budget_bytes=args.budget, get_timeout_s=5, lease_s=8)
    transport = await open_transport(args.transport, nc, js, args.namespace, settings, "peer")
    answer("ready", transport.name)
    loop = asyncio.get_running_loop()
    try:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            cmd = json.loads(line)
            if cmd["op"] == "put":
                ref = await transport.put(make_tensors(cmd["seed"]), owner=f"seed-{cmd['seed']}")
                answer("ref", msgspec.json.encode(ref).decode())
            elif cmd["op"] == "get":
                try:
                    got = await transport.get(msgspec.convert(cmd["ref"], TensorRef))
                except Exception as exc:
                    answer("error", type(exc).__name__, str(exc).replace("\n", " "))
                else:
                    answer("got", json.dumps(digests(got)))
            elif cmd["op"] == "held":
                answer("held", str(transport.held_bytes))
            elif cmd["op"] == "exit":
                break
    finally:
        await transport.close()
        await nc.close()


if __name__ == "__main__":
    asyncio.run(main())
