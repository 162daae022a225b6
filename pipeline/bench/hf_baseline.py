"""The plain-transformers baseline of ``mmpipe bench --compare-modes --hf-baseline``.

What a user gets from transformers alone: ``generate()`` serving one request
at a time, the model in one process (bf16 on the GPU). Each request is the
load's own request (the same chat prompt, the same seeded PNGs, greedy,
exactly ``max_tokens`` new tokens), prepared as the project's reference does
(stages.torch_engine.reference: the image processor, placeholders expanded,
``mm_token_type_ids``).

The load is a closed loop of ``concurrency`` clients, as ``mmpipe bench``
runs against the bridge. generate() takes no second request while it runs,
so the others wait in a FIFO queue: each request's service is measured (a
streamer stamps the first and every later token), and its waiting time
follows from the services before it. TTFT and E2E therefore include the
queueing a one-request-at-a-time server imposes, which is the point of the
comparison; ITL is generate()'s own.
"""

from __future__ import annotations

import base64
import heapq
import io
import time
from pathlib import Path
from typing import Any

from pipeline.bench.load import PROMPT, LoadReport, LoadSpec, RequestResult


class _Stamps:
    """A generate() streamer that keeps the time of every new token."""

    def __init__(self) -> None:
        self.prompt_seen = False
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        if not self.prompt_seen:  # the first put is the prompt
            self.prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class HfServer:
    def __init__(self, model_dir: Path, device: str) -> None:
        import torch
        from transformers import AutoTokenizer

        from stages.torch_engine.reference import load_reference_model

        self.model_dir = Path(model_dir)
        self.device = device
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        self.model = load_reference_model(self.model_dir, dtype=dtype, device=device)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))

    def serve(self, image_urls: list[str], max_tokens: int) -> tuple[float, list[float], float]:
        """One request: (seconds to its first token, the gaps between tokens, seconds in all)."""
        import torch
        from PIL import Image

        from stages.torch_engine.reference import reference_generate

        images = [Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB") for url in image_urls]
        content: list[dict[str, Any]] = [{"type": "image"} for _ in images]
        content.append({"type": "text", "text": PROMPT})
        messages: Any = [{"role": "user", "content": content}]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        stamps = _Stamps()
        t0 = time.perf_counter()
        prompt = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        reference_generate(self.model_dir, prompt, list(images), max_tokens, model=self.model, streamer=stamps)
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        end = time.perf_counter()
        gaps = [b - a for a, b in zip(stamps.times, stamps.times[1:], strict=False)]
        return stamps.times[0] - t0, gaps, end - t0


Service = tuple[float, list[float], float]  # HfServer.serve's: first token, gaps, all (s)


def serve_all(server: HfServer, spec: LoadSpec, images: tuple[list[str], list[list[str]]]) -> list[Service]:
    """Each request of the load served once, one at a time, after an
    unmeasured warm-up (as the bridge's)."""
    warmup, sets = images
    server.serve(warmup, spec.max_tokens)
    return [server.serve(urls, spec.max_tokens) for urls in sets]


def closed_loop(services: list[Service], spec: LoadSpec) -> LoadReport:
    """What a closed loop of ``spec.concurrency`` clients sees of a server
    that serves one request at a time, each taking its measured time: the
    time a request waits for the server is added to its TTFT and E2E. One
    measured set serves every concurrency: one at a time, how many wait
    changes nothing of the service."""
    # When each client sends its next request: all at 0 to begin with.
    ready = [0.0] * min(spec.concurrency, len(services))
    heapq.heapify(ready)
    clock = 0.0  # when the server is free next
    results: list[RequestResult] = []
    for first_s, gaps, total_s in services:
        arrival = heapq.heappop(ready)
        start = max(clock, arrival)
        clock = start + total_s
        results.append(
            RequestResult(
                ok=True,
                e2e_s=clock - arrival,
                ttft_s=start - arrival + first_s,
                itl_s=gaps,
                tokens=len(gaps) + 1,
                finish_reason="length",
            )
        )
        heapq.heappush(ready, clock)
    return LoadReport(spec=spec, results=results, wall_s=clock)


def run_hf_load(server: HfServer, spec: LoadSpec, images: tuple[list[str], list[list[str]]]) -> LoadReport:
    """The load's requests through ``server``, one at a time, with the waiting
    a closed loop of ``spec.concurrency`` clients would see."""
    return closed_loop(serve_all(server, spec, images), spec)


__all__ = ["HfServer", "Service", "closed_loop", "run_hf_load", "serve_all"]
