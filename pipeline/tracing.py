"""Traces: OpenTelemetry spans for every request, one trace across processes.

Off by default: with no tracer provider set, the OpenTelemetry API hands out
non-recording spans, which cost a function call. On (``--otlp-endpoint``,
the standard ``OTEL_EXPORTER_OTLP_ENDPOINT``, or ``--trace-nats``), each
process sends its finished spans by OTLP/HTTP to a collector (Jaeger, Tempo,
an OpenTelemetry Collector) and/or publishes them on
``mmpipe.<ns>.spans.<service>``, where ``mmpipe bench --breakdown`` reads
them without a collector. The W3C ``traceparent`` rides in every NATS
message's headers: the bridge starts a request's trace, each hop continues
it, whichever process runs the hop.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind

from schemas.settings import setting

log = structlog.get_logger(__name__)

TRACER = "mmpipe"


@dataclass(frozen=True)
class TracingSettings:
    otlp_endpoint: str = setting(
        "",
        help="send spans by OTLP/HTTP to this collector, e.g. http://127.0.0.1:4318 (unset: "
        "OTEL_EXPORTER_OTLP_ENDPOINT if set, else no OTLP export)",
    )
    trace_nats: bool = setting(
        False, help="publish finished spans on mmpipe.<ns>.spans.<process> (what mmpipe bench --breakdown reads)"
    )
    trace_sample: float = setting(
        1.0, help="the share of requests traced when tracing is on (a trace's hops follow its first)"
    )

    stack_samples: str = setting(
        "",
        help="a folder where each process writes its threads' sampled Python stacks "
        "(<process>-<pid>.folded, for flame graphs; .folded.cpu the same weighed by CPU time; .folded.gil how "
        "late the sampler woke, the GIL's business), every 10 s and at exit: where host time goes under load "
        "(unset: off)",
    )

    def __post_init__(self) -> None:
        if not 0.0 <= self.trace_sample <= 1.0:
            raise ValueError("trace-sample must be between 0 and 1")

    @property
    def endpoint(self) -> str:
        return self.otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")

    @property
    def enabled(self) -> bool:
        return bool(self.endpoint or self.trace_nats)


class SpanRecord(msgspec.Struct, array_like=True, frozen=True):
    """A finished span as it is published on NATS."""

    trace_id: str
    span_id: str
    parent_id: str
    name: str
    service: str
    start_ns: int
    end_ns: int
    attributes: dict[str, str | int | float | bool] = {}


SPAN_RECORDS = msgspec.msgpack.Decoder(list[SpanRecord])


@functools.cache
def tracer() -> trace.Tracer:
    """This process's tracer. One object: ``get_tracer`` builds a new one
    each call (5 µs, some fifteen times a request); before ``configure``
    it is a proxy that takes on the provider once one is set."""
    return trace.get_tracer(TRACER)


_nats_exporter: Any = None


def configure(settings: TracingSettings, service: str) -> bool:
    """Set this process's tracer provider; False (and nothing set) when tracing is off."""
    global _nats_exporter
    if not settings.enabled:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    provider = TracerProvider(
        resource=Resource.create({"service.name": service}),
        sampler=ParentBased(TraceIdRatioBased(settings.trace_sample)),
    )
    if settings.endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        url = settings.endpoint.rstrip("/")
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{url}/v1/traces")))
    if settings.trace_nats:
        _nats_exporter = NatsSpanExporter(service)
        provider.add_span_processor(BatchSpanProcessor(_nats_exporter, schedule_delay_millis=200))
    trace.set_tracer_provider(provider)
    log.info("tracing_on", service=service, otlp=settings.endpoint or None, nats=settings.trace_nats)
    return True


def attach_nats(nc: Any, subject: str) -> None:
    """Where this process publishes its spans, once it is connected (with --trace-nats)."""
    if _nats_exporter is not None:
        _nats_exporter.attach(nc, subject, asyncio.get_running_loop())


def shutdown() -> None:
    """Flush and stop this process's exporters, if tracing is on."""
    provider = trace.get_tracer_provider()
    if hasattr(provider, "shutdown"):
        provider.shutdown()


class NatsSpanExporter:
    """An OpenTelemetry span exporter that publishes spans on core NATS.

    The batch processor calls ``export`` on its own thread; the connection
    belongs to the event loop, so the publish is handed to the loop. Spans
    ended before the connection is attached are dropped (start-up)."""

    def __init__(self, service: str) -> None:
        self.service = service
        self._target: tuple[Any, str, asyncio.AbstractEventLoop] | None = None

    def attach(self, nc: Any, subject: str, loop: asyncio.AbstractEventLoop) -> None:
        self._target = (nc, subject, loop)

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        target = self._target
        if target is None:
            return SpanExportResult.SUCCESS
        nc, subject, loop = target
        records = [self._record(s) for s in spans]
        data = msgspec.msgpack.encode(records)
        try:
            loop.call_soon_threadsafe(lambda: loop.create_task(_publish(nc, subject, data)))
        except RuntimeError:  # the loop closed: the process is stopping
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def _record(self, span: Any) -> SpanRecord:
        ctx, parent = span.context, span.parent
        attributes = {k: v for k, v in (span.attributes or {}).items() if isinstance(v, str | int | float | bool)}
        return SpanRecord(
            trace_id=f"{ctx.trace_id:032x}",
            span_id=f"{ctx.span_id:016x}",
            parent_id=f"{parent.span_id:016x}" if parent is not None else "",
            name=span.name,
            service=self.service,
            start_ns=span.start_time or 0,
            end_ns=span.end_time or 0,
            attributes=attributes,
        )

    def shutdown(self) -> None:
        self._target = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


async def _publish(nc: Any, subject: str, data: bytes) -> None:
    try:
        await nc.publish(subject, data)
    except Exception as exc:  # spans are best effort; the request is not
        log.debug("span_publish_failed", error=repr(exc))


def inject(headers: dict[str, str]) -> dict[str, str]:
    """The current trace's ``traceparent`` into outgoing NATS headers."""
    propagate.inject(headers)
    return headers


def extracted(headers: Mapping[str, str] | None) -> otel_context.Context:
    """The trace an incoming NATS message continues."""
    return propagate.extract(headers or {})


@contextmanager
def hop_span(name: str, headers: Mapping[str, str] | None, **attributes: Any) -> Iterator[Span]:
    """A hop's span, continuing the trace of the message it took, current
    for everything the hop does (stages start their spans under it)."""
    with tracer().start_as_current_span(
        name, context=extracted(headers), kind=SpanKind.CONSUMER, attributes=attributes
    ) as span:
        yield span


@contextmanager
def request_span(name: str, headers: Mapping[str, str], **attributes: Any) -> Iterator[Span]:
    """A request's first span, as the HTTP server takes it: it continues the
    client's trace when the client sent a W3C ``traceparent`` (and keeps the
    client's sampling decision: ``-00`` is not recorded, ``-01`` is)."""
    with tracer().start_as_current_span(
        name, context=extracted(headers), kind=SpanKind.SERVER, attributes=attributes
    ) as span:
        yield span


def past_span(name: str, start_ns: int, end_ns: int, **attributes: Any) -> None:
    """A span for time measured before it could be started (a queue wait)."""
    span = tracer().start_span(name, start_time=start_ns, attributes=attributes)
    span.end(end_time=end_ns)
