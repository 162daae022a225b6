"""The whole EPD stack in the test's event loop: a real nats-server, the
processor and aggregated workers, the bridge on a free port."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import io
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp import web
from PIL import Image
from transformers import AutoTokenizer

from pipeline.bridge.app import Bridge, BridgeSettings
from pipeline.canary import CanarySettings
from pipeline.config import PipelineConfig
from pipeline.connection import connect
from pipeline.replies import stored_chunks
from pipeline.serve import WorkerSettings, build_stage, reads_decoded_media, relayed_events
from pipeline.subjects import Subjects
from pipeline.transport import TransportSettings, open_transport
from pipeline.worker import Worker
from schemas.chunk import ReplyChunk, TokenChunk
from schemas.routes import MODES, PROCESSOR, moves_tensors
from stages.media import MediaPolicy
from stages.models import ModelSpec, resolve_model
from stages.torch_engine.reference import load_reference_model, reference_generate
from stages.torch_engine.settings import DecodeSettings


def png_data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def gradient(width: int, height: int, seed: int) -> Image.Image:
    image = Image.new("RGB", (width, height))
    image.putdata(
        [
            ((x * 7 + seed * 31) % 256, (y * 5 + seed * 17) % 256, (x * y + seed) % 256)
            for y in range(height)
            for x in range(width)
        ]
    )
    return image


@dataclass
class Stack:
    base_url: str
    config: PipelineConfig
    spec: ModelSpec
    workers: list[Worker] = field(default_factory=list)
    nc: Any = None
    # add_worker(role, budget_bytes=...) -> Worker: one more worker, started.
    add_worker: Any = None
    bridge: Any = None
    # Each worker's run() task, in the order of ``workers``: done means it died.
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


@pytest.fixture
def model_spec(tiny_model_dir: Path) -> ModelSpec:
    return resolve_model(str(tiny_model_dir), "tiny-qwen2-vl")


async def start_stack(
    config: PipelineConfig,
    spec: ModelSpec,
    allow_internal: bool = True,
    bridge_settings: BridgeSettings | None = None,
    transport: str = "nixl",
    counts: dict[str, int] | None = None,
    modalities: str = "image",
    bridge_processes: bool = False,
    canary: CanarySettings | None = None,
    drain_grace_s: float = 30.0,
    frontend_decode: bool | tuple[bool, bool] = False,
    bridge_tensor_ttl_s: float = 60.0,
    engine_process: bool = False,
    decode: DecodeSettings | None = None,
) -> tuple[Stack, Any]:
    """Every role of ``config.mode`` (one worker each unless ``counts`` says
    otherwise), each with its own NATS connection and, where it moves
    tensors, its own transport, as separate processes would have.
    ``bridge_processes``: the bridge processes requests, no processor worker.
    ``canary``: every worker's canary health check; ``drain_grace_s``:
    every worker's (how long a draining or sleeping worker lets its
    requests finish). ``frontend_decode``: the processor's (bridge's) and
    the workers' --frontend-decode, one for both or (processor, workers);
    ``bridge_tensor_ttl_s``: how long the bridge holds what it decoded;
    ``engine_process``: the workers' built-in engine in a core process of its own;
    ``decode``: the workers' decode settings (default: mmpipe's)."""
    front, behind = frontend_decode if isinstance(frontend_decode, tuple) else (frontend_decode, frontend_decode)
    conns: list[Any] = []
    transports: list[Any] = []
    stack = Stack(base_url="", config=config, spec=spec)
    tasks = stack.tasks
    settings = WorkerSettings(
        model=str(spec.path),
        served_model_name=spec.served_name,
        media=MediaPolicy(allow_internal=allow_internal, frontend_decode=behind),
        modalities=modalities,
        engine_process=engine_process,
        decode=decode or DecodeSettings(),
    )
    processing = dataclasses.replace(settings, media=dataclasses.replace(settings.media, frontend_decode=front))

    async def add_worker(role: str, budget_bytes: int = 64 << 20) -> Worker:
        nc, js = await connect(config.nats_url, f"test-{role}")
        conns.append(nc)
        tensors = None
        of_role = processing if role == PROCESSOR else settings
        if moves_tensors(role) or reads_decoded_media(role, of_role):
            budget = TransportSettings(budget_bytes=budget_bytes, replicas=config.replicas or 1)
            tensors = await open_transport(transport, nc, js, config.namespace, budget, role, "cpu")
            transports.append(tensors)
        # --router kv: a worker that holds KV publishes its events (relayed on NATS).
        role_settings = relayed_events(role, config, of_role)
        stage = build_stage(role, config, role_settings, spec, tensors=tensors)
        worker = Worker(
            nc,
            js,
            config,
            stage,
            max_inflight=8,
            tensors=tensors,
            kv_events_endpoint=role_settings.kv_events.endpoint,
            canary=canary,
            drain_grace_s=drain_grace_s,
        )
        stack.workers.append(worker)
        task = asyncio.create_task(worker.run())
        tasks.append(task)
        ready = asyncio.ensure_future(worker.ready.wait())
        await asyncio.wait([ready, task], timeout=60, return_when=asyncio.FIRST_COMPLETED)
        ready.cancel()
        if task.done():
            task.result()  # what stopped the worker, now rather than after the timeout
        if not worker.ready.is_set():
            raise TimeoutError(f"the {role} worker was not ready in 60 s")
        return worker

    runners: list[web.AppRunner] = []

    async def stop(raise_worker_errors: bool = True) -> None:
        for runner in runners:
            await runner.cleanup()
        for worker in stack.workers:
            worker.stop()
        ended = await asyncio.gather(*tasks, return_exceptions=True)
        for tensors in transports:
            await tensors.close()
        for conn in conns:
            await conn.close()
        errors = [e for e in ended if isinstance(e, BaseException)]
        if errors and raise_worker_errors:
            raise errors[0]  # a worker that died during the test fails it

    stack.add_worker = add_worker
    try:
        for role in [PROCESSOR, *MODES[config.mode]]:
            for _ in range((counts or {}).get(role, 0 if role == PROCESSOR and bridge_processes else 1)):
                await add_worker(role)
        nc, js = await connect(config.nats_url, "test-bridge")
        conns.append(nc)
        stack.nc = nc
        bridge_tensors = None
        if bridge_processes and front:
            budget = TransportSettings(ttl_s=bridge_tensor_ttl_s, replicas=config.replicas or 1)
            bridge_tensors = await open_transport(transport, nc, js, config.namespace, budget, "bridge", "cpu")
            transports.append(bridge_tensors)
        processor = build_stage(PROCESSOR, config, processing, spec, bridge_tensors) if bridge_processes else None
        bridge = Bridge(
            nc,
            js,
            config,
            bridge_settings or BridgeSettings(port=0),
            processor,  # type: ignore[arg-type]
            bridge_tensors,
        )
        stack.bridge = bridge
        runner = web.AppRunner(bridge.app(), handler_cancellation=True, access_log=None)
        runners.append(runner)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
    except BaseException:
        await stop(raise_worker_errors=False)  # a stack that failed to start leaves nothing running
        raise
    host, port = runner.addresses[0][:2]
    stack.base_url = f"http://{host}:{port}"
    return stack, stop


@pytest.fixture
async def stack(pipeline_config: PipelineConfig, model_spec: ModelSpec) -> AsyncIterator[Stack]:
    s, stop = await start_stack(pipeline_config, model_spec)
    yield s
    await stop()


@pytest.fixture
async def image_server() -> AsyncIterator[str]:
    """Serves test images over http on loopback (reachable only with allow-internal)."""
    images = {f"/img{i}.png": gradient(40 + 16 * i, 56 + 8 * i, i) for i in range(8)}

    async def handle(request: web.Request) -> web.Response:
        image = images.get(request.path)
        if image is None:
            return web.Response(status=404)
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return web.Response(body=buf.getvalue(), content_type="image/png")

    app = web.Application()
    app.router.add_get("/{name}", handle)
    async with serve_on_loopback(app) as url:
        yield url


@contextlib.asynccontextmanager
async def serve_on_loopback(app: web.Application) -> AsyncIterator[str]:
    """``app`` on a free loopback port, as ``http://host:port``."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


N = 12


def make_reference(tiny_model_dir: Path) -> Any:
    """generate() on a checkpoint, for chat content as the openai client sends it."""
    model = load_reference_model(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))

    def generate(content: list[dict[str, Any]] | str, images: list[Image.Image], n: int = N) -> tuple[list[int], str]:
        if isinstance(content, str):
            messages: list[dict[str, Any]] = [{"role": "user", "content": content}]
        else:
            parts = [{"type": "image"} if p["type"] == "image_url" else p for p in content]
            messages = [{"role": "user", "content": parts}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        tokens = reference_generate(tiny_model_dir, prompt, images, max_new_tokens=n, min_new_tokens=n, model=model)
        return tokens, tokenizer.decode(tokens, skip_special_tokens=True)

    return generate


@pytest.fixture(scope="session")
def reference(tiny_model_dir: Path) -> Any:
    return make_reference(tiny_model_dir)


def client(stack: Stack, **kw: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, **kw)


def image_content(url: str, text: str = "Describe the picture.") -> list[dict[str, Any]]:
    return [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]


async def ask(
    c: openai.AsyncOpenAI, content: Any, stream: bool, n: int = N, model: str = "tiny-qwen2-vl"
) -> tuple[str, int]:
    messages = [{"role": "user", "content": content}]
    extra = {"min_tokens": n}
    if not stream:
        r = await c.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=n,
            temperature=0,
            extra_body=extra,  # type: ignore[arg-type]
        )
        assert r.choices[0].finish_reason == "length"
        assert r.usage is not None
        return r.choices[0].message.content or "", r.usage.completion_tokens
    s = await c.chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=n,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    text, usage, finish = [], 0, None
    async for chunk in s:
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage.completion_tokens
    assert finish == "length"
    return "".join(text), usage


async def finished_reply(js: Any, subjects: Subjects, request_id: str, within: float = 10.0) -> list[ReplyChunk]:
    """A request's chunks as its reply stream holds them, once the finishing
    chunk is stored (or ``within`` seconds have passed). A client hears a
    chunk as the stream stores it (core NATS and the stream's ingest are two
    paths in the server), so the last chunk may be stored a moment after
    the client's stream ended."""
    deadline = time.monotonic() + within
    while True:
        chunks = await stored_chunks(js, subjects, request_id)
        if any(isinstance(c, TokenChunk) and c.finish_reason is not None for c in chunks):
            return chunks
        if time.monotonic() > deadline:
            return chunks
        await asyncio.sleep(0.05)


async def reply_tokens(nats_url: str, request_id: str, within: float = 10.0) -> list[int]:
    """The token ids of a request as its reply stream holds them (a stack's
    namespace: default), once its finishing chunk is stored or ``within``
    seconds have passed (0: as the stream holds them now)."""
    nc, js = await connect(nats_url, name="test-reader")
    try:
        chunks = await finished_reply(js, Subjects("default"), request_id, within)
    finally:
        await nc.close()
    return [t for c in chunks for t in getattr(c, "token_ids", [])]
