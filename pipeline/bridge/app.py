"""The OpenAI-compatible HTTP bridge: HTTP in, a ``GenerateRequest`` on
``mmpipe.<ns>.requests``, ``TokenChunk``s back from the reply subject."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import re
import secrets
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import structlog
from aiohttp import web
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import MaxPayloadError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.errors import APIError, NoStreamResponseError
from opentelemetry.trace import Span
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pipeline import metrics, tracing
from pipeline.bridge import processing, responses
from pipeline.bridge.image_files import ImageFiles
from pipeline.bridge.images import IMAGES_DECODER, image_params, images_body, images_response
from pipeline.bridge.openai_types import (
    COMPLETION_DECODER,
    REQUEST_DECODER,
    StreamOptions,
    completion_to_generate_requests,
    to_generate_requests,
)
from pipeline.config import PipelineConfig
from pipeline.health import LIVE_PATH, READY_PATH
from pipeline.lora import LoraRegistry
from pipeline.replies import CHUNK_DECODER, ExactlyOnceRelay, is_final, stored_chunks
from pipeline.router.router import KvRouter
from pipeline.streams import ensure_streams, is_stream_full
from schemas.chunk import (
    ErrorChunk,
    ImageChunk,
    PromptLogprobs,
    ReplyChunk,
    TokenChunk,
    TokenLogprob,
    Usage,
    as_text,
)
from schemas.codec import CONTENT_TYPE, MSGPACK, Decoder, encode
from schemas.control import CacheCleared, Cancel, LoraCommand, LoraState, Restart, Sleep, SleepState, WorkerInfo
from schemas.errors import (
    Cancelled,
    DeadlineExceeded,
    ImageNotFound,
    InternalError,
    InvalidRequest,
    MethodNotAllowed,
    MmpipeError,
    ModelNotFound,
    NoWorkers,
    Overloaded,
    RouteNotFound,
    TooLarge,
    Unauthorized,
)
from schemas.processed import ProcessedRequest
from schemas.request import GenerateRequest
from schemas.routes import GENERATE_IMAGE, MODES, PROCESSOR
from schemas.settings import setting

if TYPE_CHECKING:
    from pipeline.transport.base import TensorTransport
    from stages.processor import Processor

log = structlog.get_logger(__name__)

T = TypeVar("T")

_WORKER_INFO: Decoder[WorkerInfo] = Decoder(WorkerInfo)
_CACHE_CLEARED: Decoder[CacheCleared] = Decoder(CacheCleared)
_SLEEP_STATE: Decoder[SleepState] = Decoder(SleepState)
_LORA_STATE: Decoder[LoraState] = Decoder(LoraState)
# An adapter's name: a key of the adapters bucket.
_LORA_NAME = re.compile(r"[A-Za-z0-9_.=-]+")
# POST /v1/cache/reset: how long to wait for the workers' answers, and for more after one.
_CACHE_RESET_WAIT_S = 5.0
_CACHE_RESET_QUIET_S = 0.5
# A reply silent this long is read back from the reply stream, then again at
# twice the wait each time up to _REPLY_CHECK_MAX_S: a chunk the bridge's
# subscription never saw, the last one above all, leaves no gap to catch it,
# and the client would wait out its whole deadline.
_REPLY_CHECK_S = 2.0
_REPLY_CHECK_MAX_S = 30.0
_RESTART: Decoder[Restart] = Decoder(Restart)

# Every chat completion's answer names its request id (the one on the NATS
# subjects and dead letters), error or not.
REQUEST_ID_HEADER = "X-Request-Id"
_REQUEST_ID: web.RequestKey[str] = web.RequestKey("mmpipe_request_id", str)
# NATS counts a message's headers against max_payload too.
_HEADER_ROOM = 1024


@dataclass(frozen=True)
class BridgeSettings:
    host: str = setting("127.0.0.1", help="the address the OpenAI API listens on (0.0.0.0: every interface)")
    port: int = setting(8000, help="the OpenAI API's port")
    api_key: str | None = setting(
        None, help="clients must send `Authorization: Bearer KEY` (unset: no key); health and metrics stay open"
    )
    # A stage that picks a request up after its deadline fails it with 504.
    request_timeout_s: float = setting(
        300.0, flag="request-timeout", help="seconds a request may take in all before it fails with 504"
    )
    max_body_bytes: int = setting(32 * 1024 * 1024, help="bytes of a request body at most (413 over it)")
    retry_after_s: int = setting(1, flag="retry-after", help="the Retry-After seconds of a 429 or 503")
    worker_cache_s: float = 1.0
    # How long a sleep or a wake fanned out to workers may take (each drains first, then frees or reloads).
    admin_wait_s: float = setting(
        120.0, flag="admin-wait", help="seconds the bridge waits for workers' answers to /sleep and /wake_up"
    )
    image_url_ttl_s: float = setting(
        3600.0,
        flag="image-url-ttl",
        help="seconds an image answered by URL (response_format url) can be fetched, from any bridge",
    )


class Bridge:
    def __init__(
        self,
        nc: Client,
        js: JetStreamContext,
        config: PipelineConfig,
        settings: BridgeSettings,
        processor: Processor | None = None,
        tensors: TensorTransport | None = None,
        image_model: str = "",
    ) -> None:
        self.nc = nc
        # The generate-image workers' model, as clients name it ("": no image stage deployed).
        self.image_model = image_model
        self.image_files = ImageFiles(js, config.subjects.images_bucket, settings.image_url_ttl_s, config.replicas or 1)
        # Where the processor holds the media it decoded (--frontend-decode).
        self.tensors = tensors
        self.js = js
        self.config = config
        self.settings = settings
        self.subjects = config.subjects
        # Requests processed here and queued for their first hop
        # (pipeline/bridge/processing.py); None: processor workers do it.
        self.processor = processor
        self._workers: dict[str, tuple[float, WorkerInfo | None]] = {}
        # A bridge that processes requests places their first hop (--router kv).
        self.router = KvRouter(nc, js, config) if config.router.kv and processor is not None else None
        # The LoRA adapters served (pipeline/lora.py): what /v1/models lists, and its processor's model names.
        self.loras = LoraRegistry(js, self.subjects, config.replicas or 1)

    # -- app -----------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.settings.max_body_bytes, middlewares=[self._errors])
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/images/generations", self.images_generations)
        app.router.add_get("/v1/images/files/{name}", self.image_file)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model)
        app.router.add_get("/health", self.health)
        app.router.add_get(READY_PATH, self.ready)
        app.router.add_get(LIVE_PATH, self.live)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/cache/reset", self.reset_cache)
        app.router.add_post("/sleep", self.sleep)
        app.router.add_post("/wake_up", self.wake_up)
        app.router.add_get("/is_sleeping", self.is_sleeping)
        app.router.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        await ensure_streams(self.js, self.config)
        if self.router is not None:
            await self.router.start()
        await self.loras.open()
        if self.processor is not None:
            self.processor.adapters = self.loras.adapters

    async def _on_cleanup(self, app: web.Application) -> None:
        if self.router is not None:
            await self.router.close()
        await self.loras.close()

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        started = time.monotonic()
        try:
            response: web.StreamResponse = await handler(request)
        except MmpipeError as exc:
            response = responses.error(exc, self.settings.retry_after_s)
        except web.HTTPRequestEntityTooLarge:
            response = responses.error(TooLarge("request body too large"), self.settings.retry_after_s)
        except web.HTTPNotFound:
            # The router's own 404 is plain text: an OpenAI client gets an error object it can read.
            response = responses.error(RouteNotFound(f"no route {request.path}"), self.settings.retry_after_s)
        except web.HTTPMethodNotAllowed as exc:
            allowed = ", ".join(sorted(exc.allowed_methods))
            refused = MethodNotAllowed(f"{request.path} takes {allowed}, not {request.method}")
            response = responses.error(refused, self.settings.retry_after_s)
            response.headers["Allow"] = allowed
        rid = request.get(_REQUEST_ID)
        if rid is not None and not response.prepared:
            # As OpenAI does: a client (the official one reads it into
            # .request_id) can name the request to an operator, error or not.
            response.headers[REQUEST_ID_HEADER] = rid
        if not response.prepared:
            # How long the bridge took to answer (a 429 must come at once; a
            # client's own clock adds its network and its event loop).
            response.headers["Server-Timing"] = f"bridge;dur={(time.monotonic() - started) * 1000:.1f}"
        # By route, not by path: any path a client makes up would be a series of its own.
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        metrics.HTTP_REQUESTS.labels(route, str(response.status)).inc()
        return response

    # -- workers -------------------------------------------------------------

    async def worker(self, role: str) -> WorkerInfo | None:
        """Any live, healthy, awake worker of a role (cached briefly: this
        sits on the request path). One whose canary failed, or that sleeps,
        answers the ping but does not count: the first other answer within
        half a second does."""
        cached = self._workers.get(role)
        now = time.monotonic()
        if cached and now - cached[0] < self.settings.worker_cache_s:
            return cached[1]
        answers = await self._gather(self.subjects.ping(role), b"", _WORKER_INFO.decode, 0.5, until=_serves)
        info = next((a for a in answers if _serves(a)), None)
        self._workers[role] = (now, info)
        return info

    async def health(self, request: web.Request) -> web.Response:
        roles = [*([] if self.processor else [PROCESSOR]), *dict.fromkeys(MODES[self.config.mode])]
        roles += [GENERATE_IMAGE] if self.image_model else []
        live = {role: (await self.worker(role)) is not None for role in roles}
        ready = self.nc.is_connected and all(live.values())
        body = {"status": "ready" if ready else "unavailable", "nats": self.nc.is_connected, "roles": live}
        return web.json_response(body, status=200 if ready else 503)

    async def ready(self, request: web.Request) -> web.Response:
        """Whether this bridge can take requests: connected to NATS. Not
        whether workers run (``/health`` says that): a bridge without them
        answers 503 ``no_workers`` itself, where a load balancer that took
        every bridge out of its pool would refuse the connection."""
        ready = self.nc.is_connected
        return web.json_response({"status": "ready" if ready else "unavailable"}, status=200 if ready else 503)

    async def live(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "live"})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.Response:
        self._authorize(request)
        return web.json_response(responses.model_list(await self._served(), self.loras.adapters))

    async def _served(self) -> list[str]:
        """The base models served (the adapters are the registry's)."""
        if self.processor is not None:
            names = self.processor.models
        else:
            info = await self.worker(PROCESSOR)
            names = info.models if info else []
        names = [*names, *([self.image_model] if self.image_model else [])]
        return [name for name in names if name not in self.loras.adapters]

    async def model(self, request: web.Request) -> web.Response:
        """One served model, as ``/v1/models`` lists it; 404 ``model_not_found`` for another."""
        self._authorize(request)
        name = request.match_info["model"]
        listed = [m for m in responses.model_list(await self._served(), self.loras.adapters)["data"] if m["id"] == name]
        if not listed:
            raise ModelNotFound(f"model {name!r} is not served")
        return web.json_response(listed[0])

    async def _gather(
        self,
        subject: str,
        payload: bytes,
        decode: Callable[[bytes], T],
        wait_s: float,
        expected: int | None = None,
        until: Callable[[T], bool] | None = None,
    ) -> list[T]:
        """The answers of every worker a request reaches: ``expected`` of
        them within ``wait_s``, or up to the first that satisfies ``until``,
        or, not knowing how many, those that come before a pause of
        ``_CACHE_RESET_QUIET_S`` after the first."""
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        answers: list[T] = []
        try:
            await self.nc.publish(subject, payload, reply=inbox)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + wait_s
            while (left := deadline - loop.time()) > 0 and (expected is None or len(answers) < expected):
                # After the first answer, a pause this long means the rest have answered.
                wait = min(left, _CACHE_RESET_QUIET_S) if answers and expected is None and until is None else left
                try:
                    msg = await sub.next_msg(timeout=wait)
                except (NatsTimeoutError, TimeoutError):
                    break
                if not msg.data:  # the server's "no responders" status
                    break
                answers.append(decode(msg.data))
                if until is not None and until(answers[-1]):
                    break
        finally:
            await sub.unsubscribe()
        return answers

    async def reset_cache(self, request: web.Request) -> web.Response:
        """Every worker forgets its prefix cache: each one's answer, as it
        comes within a short wait (an admin's call, behind the API key)."""
        self._authorize(request)
        answers = await self._gather(self.subjects.cache_reset, b"", _CACHE_CLEARED.decode, _CACHE_RESET_WAIT_S)
        if not answers:
            raise NoWorkers("no worker answered the cache reset")
        failed = [a for a in answers if a.error]
        for answer in failed:
            metrics.ERRORS.labels("bridge", "cache_reset_failed").inc()
            log.error("cache_reset_failed", worker_id=answer.worker_id, role=answer.role, error=answer.error)
        body = {
            "blocks": sum(a.blocks for a in answers),
            "workers": [msgspec.structs.asdict(a) for a in sorted(answers, key=lambda a: (a.role, a.worker_id))],
        }
        return web.json_response(body, status=500 if failed else 200)

    # -- LoRA adapters at run time, vLLM's endpoints ----------------------------

    def _lm_roles(self) -> list[str]:
        """The mode's roles that run the language model (and so load adapters)."""
        return [r for r in dict.fromkeys(MODES[self.config.mode]) if {"prefill", "decode"} & set(r.split("+"))]

    async def _lora_fanout(self, command: LoraCommand) -> list[LoraState]:
        """``command`` to every worker that runs the language model, and to
        the processor workers (they take the name as a model at once, not
        when the bucket's change reaches them)."""

        roles = [*self._lm_roles(), *([] if self.processor is not None else [PROCESSOR])]
        asked = [self._ask_role(r, self.subjects.lora(r), encode(command), _LORA_STATE.decode) for r in roles]
        states = [state for answers in await asyncio.gather(*asked) for state in answers]
        self._workers.clear()  # their models changed
        return states

    async def _lora_body(self, request: web.Request, *fields: str) -> list[str]:
        try:
            body = await request.json()
        except ValueError:
            raise InvalidRequest("the body must be JSON") from None
        values: list[str] = []
        for name in fields:
            value = body.get(name) if isinstance(body, dict) else None
            if not isinstance(value, str) or not value:
                raise InvalidRequest(f"{name} must be a non-empty string")
            values.append(value)
        return values

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /v1/load_lora_adapter {lora_name, lora_path}``:
        every worker that runs the language model loads the adapter now (a
        bad one is a 400 naming why, and none keeps it); then it is served,
        to workers started later too, until it is unloaded."""
        self._authorize(request)
        name, path = await self._lora_body(request, "lora_name", "lora_path")
        if not _LORA_NAME.fullmatch(name):
            raise InvalidRequest("lora_name: letters, digits, '_', '-', '.' and '=' only")
        if name in await self._served():
            raise InvalidRequest(f"lora_name {name!r} is the base model's")
        if name in self.loras.adapters:
            raise InvalidRequest(f"The lora adapter '{name}' has already been loaded.")
        states = [s for s in await self._lora_fanout(LoraCommand(name, path)) if s.role != PROCESSOR]
        if not states:
            raise NoWorkers("no worker that runs the language model answered")
        if not any(s.supported for s in states):
            raise InvalidRequest("LoRA adapters are not taken by this deployment's engine")
        if failed := [s for s in states if s.error or not s.supported]:
            await self._lora_fanout(LoraCommand(name))  # none keeps it
            why = failed[0].error or f"the {failed[0].role} worker's engine takes no LoRA adapters"
            raise InvalidRequest(f"LoRA adapter {name!r} could not be loaded: {why}")
        await self.loras.put(name, path)
        log.info("lora_loaded", adapter=name, path=path, workers=len(states))
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /v1/unload_lora_adapter {lora_name}``: no longer
        served; each worker unloads it once no request of its uses it."""
        self._authorize(request)
        [name] = await self._lora_body(request, "lora_name")
        if name not in self.loras.adapters:
            raise ModelNotFound(f"The lora adapter '{name}' cannot be found.")
        await self.loras.delete(name)
        if failed := [s for s in await self._lora_fanout(LoraCommand(name)) if s.error]:
            for state in failed:
                metrics.ERRORS.labels("bridge", "lora_unload_failed").inc()
                log.error("lora_unload_failed", worker_id=state.worker_id, role=state.role, error=state.error)
        log.info("lora_unloaded", adapter=name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    # -- sleep mode, vLLM's endpoints, fanned out to a role's workers -----------

    def _roles(self, request: web.Request) -> list[str]:
        """``?role=`` (one of the mode's hops), or every hop of the mode."""
        hops = list(dict.fromkeys(MODES[self.config.mode]))
        role = request.query.get("role")
        if role is None:
            return hops
        # An unescaped "+" in a query string reads as a space; no role has one.
        role = role.replace(" ", "+")
        if role not in hops:
            raise InvalidRequest(f"role {role!r}: one of {', '.join(hops)}")
        return [role]

    async def _workers_of(self, role: str) -> list[WorkerInfo]:
        return await self._gather(self.subjects.ping(role), b"", _WORKER_INFO.decode, 0.5)

    async def _ask_role(self, role: str, subject: str, payload: bytes, decode: Callable[[bytes], T]) -> list[T]:
        """``payload`` to every worker of ``role`` on ``subject``: each one's
        answer, waiting for as many as answer a ping (each may drain first)."""
        workers = await self._workers_of(role)
        if not workers:
            return []
        return await self._gather(subject, payload, decode, self.settings.admin_wait_s, expected=len(workers))

    async def _sleep_roles(self, roles: list[str], level: int) -> list[SleepState]:
        """``Sleep(level)`` to every worker of ``roles`` (0: wake up), each one's answer."""

        asked = [self._ask_role(r, self.subjects.sleep(r), encode(Sleep(level)), _SLEEP_STATE.decode) for r in roles]
        states = [state for answers in await asyncio.gather(*asked) for state in answers]
        self._workers.clear()  # the live set changed
        if not states:
            raise NoWorkers(f"no worker of {', '.join(roles)} answered")
        return states

    async def sleep(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /sleep?level=1|2``, to every worker of ``?role=`` (or
        of every hop): each finishes or hands back what it holds, stops
        fetching and gives its device's memory back (an admin's call)."""
        self._authorize(request)
        try:
            level = int(request.query.get("level", "1"))
        except ValueError:
            level = 0
        if level not in (1, 2):
            raise InvalidRequest("level: 1 (weights to host memory) or 2 (weights dropped)")
        return _sleep_states(await self._sleep_roles(self._roles(request), level))

    async def wake_up(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /wake_up``: every sleeping worker of ``?role=`` (or of every hop) reloads and fetches again."""
        self._authorize(request)
        return _sleep_states(await self._sleep_roles(self._roles(request), 0))

    async def is_sleeping(self, request: web.Request) -> web.Response:
        """vLLM's ``GET /is_sleeping``: true when every worker of ``?role=``
        (or of every hop) sleeps; each worker's level beside it."""
        self._authorize(request)
        workers = [w for role in self._roles(request) for w in await self._workers_of(role)]
        listed = [{"role": w.role, "worker_id": w.worker_id, "sleeping": w.sleeping} for w in workers]
        asleep = bool(workers) and all(w.sleeping > 0 for w in workers)
        return web.json_response({"is_sleeping": asleep, "workers": sorted(listed, key=lambda w: str(w["worker_id"]))})

    def _authorize(self, request: web.Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise Unauthorized("a valid API key is required (Authorization: Bearer <key>)")

    # -- chat completions ----------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        self._authorize(request)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        request[_REQUEST_ID] = rid
        # The request's trace starts here (or continues the client's); every
        # hop continues it (traceparent in the NATS headers).
        with tracing.request_span("bridge", request.headers, request_id=rid):
            return await self._chat_completions(request, rid)

    async def _chat_completions(self, request: web.Request, rid: str) -> web.StreamResponse:
        body_bytes = await request.read()
        body = _decoded(REQUEST_DECODER, body_bytes)
        now = time.time()
        gens = to_generate_requests(body, rid, created=now, deadline=now + self.settings.request_timeout_s)
        include, continuous = _usage_options(body.stream_options)
        drawn = bool(self.image_model) and body.model == self.image_model
        if drawn:
            # The image model by name in a chat: the served model writes the
            # answer, and the image stage draws it (its prompt: the answer).
            text_model = next((name for name in await self._served() if name != self.image_model), None)
            if text_model is None or await self.worker(GENERATE_IMAGE) is None:
                # Refused now, not after the text: the image hop would wait in its queue to the deadline.
                raise NoWorkers("no model to write the text" if text_model is None else f"no {GENERATE_IMAGE} worker")
            drawing = body.drawing()
            gens = [msgspec.structs.replace(g, model=text_model, image=drawing) for g in gens]
        elif asked := body.drawing_asked():
            raise InvalidRequest(f"{', '.join(asked)}: only for a chat naming the image model")
        reply = responses.Reply(include_usage=include, continuous_usage=continuous, n=body.n, images=drawn)
        return await self._serve(request, rid, gens, len(body_bytes), reply, body.user, shown=body.model)

    # -- completions -----------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """``/v1/completions``: a prompt as it is, no chat template, the same
        route and reply stream as chat."""
        self._authorize(request)
        rid = f"cmpl-{uuid.uuid4().hex}"
        request[_REQUEST_ID] = rid
        with tracing.request_span("bridge", request.headers, request_id=rid):
            body_bytes = await request.read()
            body = _decoded(COMPLETION_DECODER, body_bytes)
            now = time.time()
            gens = completion_to_generate_requests(
                body, rid, created=now, deadline=now + self.settings.request_timeout_s
            )
            include, continuous = _usage_options(body.stream_options)
            echoes = tuple(g.prompt for g in gens[:: body.n] if isinstance(g.prompt, str)) if body.echo else ()
            reply = responses.Reply(
                chat=False, include_usage=include, continuous_usage=continuous, echoes=echoes, n=body.n
            )
            return await self._serve(request, rid, gens, len(body_bytes), reply, body.user)

    # -- images ----------------------------------------------------------------

    async def images_generations(self, request: web.Request) -> web.Response:
        """``/v1/images/generations``: one hop, ``generate-image``, queued
        from here; its images come back on the reply subject, whole."""
        self._authorize(request)
        rid = f"img-{uuid.uuid4().hex}"
        request[_REQUEST_ID] = rid
        with tracing.request_span("bridge", request.headers, request_id=rid):
            body = _decoded(IMAGES_DECODER, await request.read())
            params = image_params(body)
            info = await self.worker(GENERATE_IMAGE)
            if info is None:
                raise NoWorkers(f"no {GENERATE_IMAGE} worker is running")
            model = body.model or info.models[0]
            if model not in info.models:
                raise ModelNotFound(f"model {model!r} is not served for images; served: {', '.join(info.models)}")
            now = time.time()
            deadline = now + self.settings.request_timeout_s
            asked = GenerateRequest(rid, model, [], image=params, created=now, deadline=deadline)
            # Fixed here, as the processor fixes a text request's: a takeover draws the same images.
            seed = params.seed if params.seed is not None else secrets.randbits(63)
            hop = ProcessedRequest(asked, [], [], [GENERATE_IMAGE], max_tokens=0, seed=seed)
            structlog.contextvars.bind_contextvars(request_id=rid, **({"user": body.user} if body.user else {}))
            sub = await self.nc.subscribe(self.subjects.reply(rid))
            try:
                await self._submit(self.subjects.work(GENERATE_IMAGE), f"{rid}:0:0", self._encode_request(hop))
                images = []
                async for chunk in self._chunks(sub, rid, deadline):
                    if isinstance(chunk, ErrorChunk):
                        return responses.error_chunk(chunk, self.settings.retry_after_s)
                    if not isinstance(chunk, ImageChunk):
                        log.error("text_in_image_reply", request_id=rid)
                        raise InternalError("text in an image request's reply")
                    images.append(chunk)
                urls = None
                if body.response_format == "url":
                    base = f"{request.url.origin()}/v1/images/files"
                    ordered = sorted(images, key=lambda c: c.index)
                    urls = [f"{base}/{await self.image_files.put(c.data, c.media_type)}" for c in ordered]
                answer = images_body(images_response(int(now), images, urls))
                return web.Response(body=answer, content_type="application/json")
            except asyncio.CancelledError:
                await self._cancel(rid)
                raise
            finally:
                await sub.unsubscribe()
                structlog.contextvars.unbind_contextvars("request_id", "user")

    async def image_file(self, request: web.Request) -> web.Response:
        """An image answered by URL, while its bucket keeps it (no API key:
        its name is the secret, as a signed URL's signature is)."""
        found = await self.image_files.get(request.match_info["name"])
        if found is None:
            raise ImageNotFound("no such image: its URL was never given, or its time (--image-url-ttl) is up")
        data, media_type = found
        return web.Response(body=data, content_type=media_type)

    async def _serve(
        self,
        request: web.Request,
        rid: str,
        gens: list[GenerateRequest],
        body_bytes: int,
        reply: responses.Reply,
        user: str | None,
        shown: str | None = None,
    ) -> web.StreamResponse:
        """A request's choices, one queued request each (one, unless ``n`` or
        several prompts), answered as one response (its ``model`` the one
        asked for: ``shown``, where the work runs on another name)."""
        now = gens[0].created
        # OpenAI's end-user id: on every log line of the request, for an operator to follow abuse.
        structlog.contextvars.bind_contextvars(request_id=rid, **({"user": user} if user else {}))
        subs: list[Subscription] = []
        try:
            # Each choice processed before any is queued: a bad request queues nothing.
            queued = [await self._queueable(gen, body_bytes) for gen in gens]
            first = queued[0][1]
            info = await self.worker(first)
            if info is None:
                raise NoWorkers(f"no {first} worker is running")
            if gens[0].model not in info.models:
                raise ModelNotFound(f"model {gens[0].model!r} is not served; served: {', '.join(info.models)}")
            model = shown or gens[0].model
            streams = []
            try:
                for gen, (submit, _, processed) in zip(gens, queued, strict=True):
                    sub = await self.nc.subscribe(self.subjects.reply(gen.request_id))
                    subs.append(sub)
                    if processed is not None:
                        subs.append(
                            await self.nc.subscribe(
                                self.subjects.restart(gen.request_id), cb=self._restarter(processed)
                            )
                        )
                    await self._submit(*submit)
                    streams.append(self._chunks(sub, gen.request_id, gen.deadline, images=gen.image is not None))
                finished: set[int] = set()
                async with contextlib.aclosing(_merged(streams, finished)) as chunks:
                    if gens[0].stream:
                        answer = await self._stream(request, rid, model, int(now), chunks, reply, len(gens))
                    else:
                        answer = await self._complete(rid, model, int(now), chunks, reply, len(gens))
                # A choice that failed ends the answer: the others still at work stop.
                await self._cancel_all([gen for i, gen in enumerate(gens) if i not in finished])
                return answer
            except asyncio.CancelledError:
                # The client went away: stop the work wherever it is.
                await self._cancel_all(gens)
                raise
            except ConnectionResetError:
                # It went away while we wrote to it: the same, and not an error
                # of ours (raised on, aiohttp would log a 500's traceback).
                await self._cancel_all(gens)
                log.info("client_gone", request_id=rid)
                return web.Response(status=499)
            except MmpipeError:
                # One choice failed (its deadline, say): the others stop too.
                if len(gens) > 1:
                    await self._cancel_all(gens)
                raise
        finally:
            for sub in subs:
                await sub.unsubscribe()
            if self.tensors is not None:
                # Decoded media no encoder read (the request failed or was
                # cancelled first) are freed now, not at their TTL.
                for gen in gens:
                    await self.tensors.release_owner(gen.request_id)
            structlog.contextvars.unbind_contextvars("request_id", "user")

    async def _queueable(
        self, gen: GenerateRequest, body_bytes: int
    ) -> tuple[tuple[str, str, bytes], str, ProcessedRequest | None]:
        """What to queue for one choice (subject, message id, data), the role
        of its first hop, and the request as processed here (if it was)."""
        rid = gen.request_id
        if self.processor is None:
            return (self.subjects.requests, f"{rid}:0:request", self._encode_request(gen)), PROCESSOR, None
        processed = await processing.process(self.processor, gen, body_bytes)
        # This bridge holds the request while its client waits: hops past the
        # media's encoding drop the inline bytes, and a restart comes back here.
        processed = msgspec.structs.replace(processed, bridge_restarts=True)
        # A restart queues the request as it arrived: its first hop decodes the media itself.
        first = await processing.decoded(self.processor, processed)
        # The id the first hop's message would have had from a processor worker.
        subject, first = self._first_hop(first)
        submit = (subject, f"{rid}:0:{first.hop_index}", self._encode_request(first))
        return submit, processed.hop, processed

    async def _cancel_all(self, gens: list[GenerateRequest]) -> None:
        for gen in gens:
            await self._cancel(gen.request_id)

    def _restarter(self, processed: ProcessedRequest) -> Callable[[Msg], Awaitable[None]]:
        """A hop lost what an earlier hop made and its message no longer
        carries the media: queue the request as it arrived again, from its
        first hop, as the attempt asked for (once each: a repeated ask is
        answered without queueing it twice)."""
        rid = processed.request.request_id

        async def restart(msg: Msg) -> None:
            try:
                ask = _RESTART.decode(msg.data)
                subject, again = self._first_hop(msgspec.structs.replace(processed, attempt=ask.attempt))
                await self._submit(subject, f"{rid}:{ask.attempt}:{again.hop_index}", encode(again))
            except (msgspec.DecodeError, msgspec.ValidationError, MmpipeError) as exc:
                metrics.ERRORS.labels("bridge", "restart_failed").inc()
                log.warning("restart_failed", request_id=rid, error=repr(exc))
                return  # no answer: the hop's request times out and it tries again later
            log.info("request_restarted", request_id=rid, attempt=ask.attempt)
            await msg.respond(b"")

        return restart

    def _first_hop(self, processed: ProcessedRequest) -> tuple[str, ProcessedRequest]:
        """Where the request's first message goes, and as what (the router may send it past the encode hop)."""
        if self.router is not None:
            return self.router.place(processed)
        return self.subjects.work(processed.hop), processed

    def _encode_request(self, message: GenerateRequest | ProcessedRequest) -> bytes:
        """The request as it goes on NATS, or the client's error: a number
        msgpack cannot carry (JSON integers are unbounded), or a request larger
        than one NATS message may be."""
        try:
            data = encode(message)
        except OverflowError:
            raise InvalidRequest("an integer in the request is out of range (at most 64 bits)") from None
        limit = self.nc.max_payload - _HEADER_ROOM
        if len(data) > limit:
            raise TooLarge(f"the request is {len(data)} bytes as a message; the limit is {limit} bytes")
        return data

    async def _submit(self, subject: str, msg_id: str, data: bytes) -> None:
        headers = tracing.inject({CONTENT_TYPE: MSGPACK, "Nats-Msg-Id": msg_id})
        try:
            await self.js.publish(subject, data, headers=headers, timeout=5.0)
        except MaxPayloadError:
            raise TooLarge("the request is larger than one NATS message may be") from None
        except APIError as exc:
            if is_stream_full(exc):
                raise Overloaded("the request queue is full; retry later") from None
            raise NoWorkers(f"could not queue the request: {exc.description}") from None
        except (NoStreamResponseError, NatsTimeoutError, TimeoutError):
            raise NoWorkers("JetStream did not take the request") from None

    async def _cancel(self, rid: str) -> None:
        try:
            await self.nc.publish(self.subjects.cancel(rid), encode(Cancel(request_id=rid)))
        except Exception as exc:
            metrics.ERRORS.labels("bridge", "cancel_failed").inc()
            log.error("cancel_publish_failed", error=repr(exc))

    async def _chunks(
        self, sub: Subscription, rid: str, deadline: float, images: bool = False
    ) -> AsyncIterator[ReplyChunk]:
        """The request's chunks, each once (``images``: its text, then images drawn after it)."""
        # From the request queued to its first chunk here: the time to first token the bridge adds nothing to.
        waiting: Span | None = tracing.tracer().start_span("first_token")
        async for chunk in self._relayed(sub, rid, deadline, images):
            if waiting is not None:
                waiting.end()
                waiting = None
            yield await self._image_read(chunk) if isinstance(chunk, ImageChunk) and chunk.ref else chunk

    async def _image_read(self, chunk: ImageChunk) -> ImageChunk:
        """An image too large to ride in its chunk, read from the worker
        that drew it (and let go there)."""
        ref = chunk.ref
        assert ref is not None
        if self.tensors is None:
            log.error("image_by_reference_unreadable", request_id=chunk.request_id)
            raise InternalError("an image came by reference to a bridge with no tensor transport (--image-model)")
        [data] = await self.tensors.get(ref)
        await self.tensors.release(ref)
        return msgspec.structs.replace(chunk, data=data.numpy().tobytes(), ref=None)

    async def _relayed(
        self, sub: Subscription, rid: str, deadline: float, images: bool = False
    ) -> AsyncIterator[ReplyChunk]:
        relay = ExactlyOnceRelay(text_then_images=images)
        reconnects = self.nc.stats["reconnects"]
        quiet_s = _REPLY_CHECK_S
        check_at = time.monotonic() + quiet_s
        while not relay.done:
            remaining = deadline - time.time()
            if remaining <= 0:
                raise DeadlineExceeded("the request's deadline passed")
            try:
                msg = await sub.next_msg(timeout=min(remaining, 1.0, max(check_at - time.monotonic(), 0.01)))
            except (NatsTimeoutError, TimeoutError):
                if self.nc.stats["reconnects"] != reconnects and self.nc.is_connected:
                    # Chunks published while this bridge was reconnecting never
                    # reached its subscription (the last one among them, maybe).
                    reconnects = self.nc.stats["reconnects"]
                    async for missed in self._backfill(rid, relay, "reconnect"):
                        yield missed
                elif time.monotonic() >= check_at and self.nc.is_connected:
                    async for missed in self._backfill(rid, relay, "silence"):
                        yield missed
                    quiet_s = min(quiet_s * 2, _REPLY_CHECK_MAX_S)
                    check_at = time.monotonic() + quiet_s
                continue
            quiet_s = _REPLY_CHECK_S
            check_at = time.monotonic() + quiet_s
            try:
                chunk = CHUNK_DECODER.decode(msg.data, (msg.headers or {}).get(CONTENT_TYPE))
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                metrics.ERRORS.labels("bridge", "bad_chunk").inc()
                log.error("bad_reply_chunk", error=str(exc))
                continue
            if relay.is_gap(chunk):
                async for missed in self._backfill(rid, relay, "gap"):
                    yield missed
            accepted = relay.accept(chunk)
            if accepted is not None:
                yield accepted

    async def _backfill(self, rid: str, relay: ExactlyOnceRelay, why: str) -> AsyncIterator[ReplyChunk]:
        """What the reply stream holds that this relay has not passed on yet."""
        try:
            stored = await stored_chunks(self.js, self.subjects, rid)
        except Exception as exc:  # the stream is not reachable right now: the next gap or timeout tries again
            metrics.ERRORS.labels("bridge", "backfill_failed").inc()
            log.warning("reply_backfill_failed", request_id=rid, why=why, error=repr(exc))
            return
        recovered = 0
        for chunk in stored:
            accepted = relay.accept(chunk)
            if accepted is not None:
                # A chunk published that the bridge's subscription did not see.
                metrics.REPLY_CHUNKS_RECOVERED.labels(why).inc()
                recovered += 1
                yield accepted
        if recovered:
            log.warning("reply_backfilled", request_id=rid, why=why, recovered=recovered, next_seq=relay.next_seq)

    async def _complete(
        self,
        rid: str,
        model: str,
        created: int,
        chunks: AsyncIterator[tuple[int, ReplyChunk]],
        reply: responses.Reply,
        choices: int,
    ) -> web.Response:
        texts: list[list[str]] = [[] for _ in range(choices)]
        lasts: list[TokenChunk | None] = [None] * choices
        logprobs: list[list[TokenLogprob] | None] = [None] * choices
        prompts: list[PromptLogprobs | None] = [None] * choices
        pictures: list[list[ImageChunk]] = [[] for _ in range(choices)]
        async for index, received in chunks:
            if reply.images and isinstance(received, ImageChunk):
                pictures[index].append(received)
                continue
            chunk = as_text(received)
            if isinstance(chunk, ErrorChunk):
                return responses.error_chunk(chunk, self.settings.retry_after_s)
            texts[index].append(chunk.text)
            lasts[index] = chunk
            if chunk.prompt_logprobs is not None:
                prompts[index] = chunk.prompt_logprobs
            if chunk.logprobs is not None:
                got = logprobs[index]
                if got is None:
                    got = logprobs[index] = []
                got.extend(chunk.logprobs)
        answers = []
        for text, last, lps, prompt, drawn in zip(texts, lasts, logprobs, prompts, pictures, strict=True):
            assert last is not None
            answers.append(responses.Answer("".join(text), last, lps, prompt, sorted(drawn, key=lambda i: i.index)))
        return web.json_response(responses.completion(rid, model, created, answers, reply))

    async def _stream(
        self,
        request: web.Request,
        rid: str,
        model: str,
        created: int,
        chunks: AsyncIterator[tuple[int, ReplyChunk]],
        reply: responses.Reply,
        choices: int,
    ) -> web.StreamResponse:
        response: web.StreamResponse | None = None
        # Per choice: its first chunk's usage (the prompt's size, for usage on
        # every chunk; None until its first chunk), its final usage, and when
        # its last chunk was written here: the gaps beside the worker's own (as
        # it published them), where a burst came in between.
        prompts: list[Usage | None] = [None] * choices
        finals: list[Usage | None] = [None] * choices
        started = [False] * choices
        sent: list[float | None] = [None] * choices
        # A text completion's place in each choice's text, for its tokens' text_offset.
        offsets = [len(reply.echo(i)) for i in range(choices)]
        # With images after the text: each choice's images so far, and its
        # text's finish reason, held for the last chunk (the images').
        pictures: list[list[ImageChunk]] = [[] for _ in range(choices)]
        held: list[str | None] = [None] * choices
        texted = [False] * choices

        async def images_once_whole(index: int) -> None:
            # The images' chunk goes last, once the text ended and every image is in (either may come first).
            drawn = pictures[index]
            if texted[index] and drawn and len(drawn) == drawn[0].count and response is not None:
                body = responses.image_chunk(rid, model, created, drawn, held[index], index)
                await response.write(responses.sse(body))

        async for index, received in chunks:
            if reply.images and isinstance(received, ImageChunk):
                pictures[index].append(received)
                await images_once_whole(index)
                continue
            chunk = as_text(received)
            if isinstance(chunk, ErrorChunk):
                if response is None:
                    # Nothing sent yet: the client gets a proper HTTP error.
                    return responses.error_chunk(chunk, self.settings.retry_after_s)
                await response.write(responses.sse(responses.error_body_from_chunk(chunk)))
                break
            if response is None:
                response = web.StreamResponse(
                    headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", REQUEST_ID_HEADER: rid}
                )
                await response.prepare(request)
            first = not started[index]
            if first:
                started[index], prompts[index] = True, chunk.usage
            shown = msgspec.structs.replace(chunk, finish_reason=None) if reply.images else chunk
            body = responses.stream_chunk(
                rid, model, created, shown, first, reply, prompts[index], index, offsets[index]
            )
            offsets[index] = responses.logprobs_text_end(chunk, offsets[index])
            await response.write(responses.sse(body))
            now = time.perf_counter()
            if (last := sent[index]) is not None:
                metrics.ITL.labels("bridge").observe(now - last)
            sent[index] = now
            if chunk.finish_reason is not None:
                finals[index] = chunk.usage
                if reply.images:
                    texted[index], held[index] = True, chunk.finish_reason.value
                    await images_once_whole(index)
        else:
            usage = responses.total_usage(finals, reply.n)
            if response is not None and reply.include_usage and usage is not None:
                await response.write(responses.sse(responses.usage_chunk(rid, model, created, usage, reply)))
        if response is None:
            raise Cancelled("the request ended without output")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def _merged(
    streams: list[AsyncIterator[ReplyChunk]], finished: set[int]
) -> AsyncGenerator[tuple[int, ReplyChunk], None]:
    """The choices' chunks as they come, each with its choice's index (into
    ``finished`` once its last chunk is out); the first failure (a deadline,
    say) raises here and stops the others."""
    if len(streams) == 1:
        async for chunk in streams[0]:
            if is_final(chunk):
                finished.add(0)
            yield 0, chunk
        return
    queue: asyncio.Queue[tuple[int, ReplyChunk | Exception | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[ReplyChunk]) -> None:
        try:
            async for chunk in stream:
                await queue.put((index, chunk))
        except Exception as exc:
            await queue.put((index, exc))
        else:
            await queue.put((index, None))

    pumps = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        running = len(pumps)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                if is_final(item):
                    finished.add(index)
                yield index, item
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


def _usage_options(options: StreamOptions | None) -> tuple[bool, bool]:
    """A stream's usage: at its end (include_usage), and with every chunk
    too (vLLM's continuous_usage_stats, which takes include_usage as well)."""
    include = bool(options and options.include_usage)
    return include, include and bool(options and options.continuous_usage_stats)


def _decoded(decoder: msgspec.json.Decoder[T], body: bytes) -> T:
    try:
        return decoder.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError) as exc:
        # UnicodeDecodeError: a string that is not UTF-8, which msgspec reports as such.
        raise InvalidRequest(f"invalid request body: {exc}") from None


def _sleep_states(states: list[SleepState]) -> web.Response:
    """Workers' answers to a sleep or a wake: 500 where one failed, 501
    where none has a sleep mode."""
    failed = [s for s in states if s.error]
    for state in failed:
        metrics.ERRORS.labels("bridge", "sleep_failed").inc()
        log.error("sleep_failed", worker_id=state.worker_id, role=state.role, error=state.error)
    supported = [s for s in states if s.supported]
    status = 500 if failed else 200 if supported else 501
    body = {
        "is_sleeping": bool(supported) and all(s.sleeping > 0 for s in supported),
        "workers": [msgspec.structs.asdict(s) for s in sorted(states, key=lambda s: (s.role, s.worker_id))],
    }
    return web.json_response(body, status=status)


def _serves(info: WorkerInfo) -> bool:
    """A ping's answer from a worker that takes work: healthy and awake."""
    return info.healthy and not info.sleeping
