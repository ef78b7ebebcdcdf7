"""The OpenTelemetry tracer (`specroute[otel]`): one span per request, exported over OTLP/HTTP.

Imported only when `tracing.enabled` (router.runtime). Nothing global is set: the tracer
provider, the W3C propagator and the exporter belong to one router. Spans go out in batches
from the SDK's own thread, through a bounded queue (what a slow collector cannot take is dropped,
never held); the settings' endpoint, sampling and service name win over the `OTEL_*` variables,
which the SDK reads for everything left unset.
"""

from __future__ import annotations

import asyncio
import time

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from router.config import Tracing
from router.request.incoming import Arrival
from router.request.observe import Finished
from router.tracing import TRACE_HEADERS

_PROPAGATOR = TraceContextTextMapPropagator()  # stateless: W3C traceparent and tracestate
_ENDPOINTS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/audio/transcriptions",
        "/v1/files",
        "/v1/batches",
    }
)


class OtelTracer:
    def __init__(self, config: Tracing, *, version: str) -> None:
        attributes = {SERVICE_VERSION: version}
        if config.service_name is not None:
            attributes[SERVICE_NAME] = config.service_name
        resource = Resource.create(attributes)
        if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
            resource = resource.merge(Resource({SERVICE_NAME: "specroute"}))
        sampler = ParentBased(TraceIdRatioBased(config.sample_ratio)) if config.sample_ratio is not None else None
        self._provider = TracerProvider(sampler=sampler, resource=resource, shutdown_on_exit=False)
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=config.endpoint)))
        self._tracer = self._provider.get_tracer("specroute", version)

    def start(self, arrival: Arrival, age: float) -> _Span:
        headers = arrival.headers
        carrier = {key: headers[key] for key in TRACE_HEADERS if key in headers}
        parent = _PROPAGATOR.extract(carrier) if carrier else None
        # A span's name is one of few (OpenTelemetry's HTTP conventions): the path only where it names an endpoint.
        path = arrival.path if arrival.path in _ENDPOINTS else "/v1/{path}"
        # From the arrival on: what the span holds (its first token, its queue wait) fits in it.
        started = time.time_ns() - round(age * 1e9)
        span = self._tracer.start_span(
            f"{arrival.method} {path}", context=parent, kind=SpanKind.SERVER, start_time=started
        )
        return _Span(span)

    async def aclose(self) -> None:
        await asyncio.to_thread(self._provider.shutdown)  # flushes what is queued, within the exporter's timeout


class _Span:
    __slots__ = ("_span",)

    def __init__(self, span: trace.Span) -> None:
        self._span = span

    def upstream_headers(self) -> list[tuple[str, str]]:
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(self._span))
        return list(carrier.items())

    def end(self, done: Finished) -> None:
        span = self._span
        if span.is_recording():
            span.set_attributes(attributes(done))
            if done.status >= 500:
                span.set_status(Status(StatusCode.ERROR, done.code))
        span.end()


def attributes(done: Finished) -> dict[str, str | int | float | bool]:
    """A request's span attributes: OpenTelemetry's HTTP and GenAI names where they exist, then
    the router's decision (docs/tracing.md lists them)."""
    found: dict[str, str | int | float | bool | None] = {
        "http.request.method": done.arrival.method,
        "url.path": done.arrival.path,
        "http.response.status_code": done.status,
        "error.type": done.code,
        "gen_ai.request.model": done.model,
        "gen_ai.usage.output_tokens": done.tokens,
        "gen_ai.usage.input_tokens": done.prompt_tokens,
        "specroute.request_id": done.arrival.request_id,
        "specroute.attempts": done.attempts,
        "specroute.queue_wait_seconds": done.queue_wait,
        "specroute.ttft_seconds": done.ttft,
        "specroute.spec.accept_length": done.accept_length,
    }
    decision = done.decision
    if decision is not None:
        found |= {
            "specroute.job_class": decision.job,
            "specroute.content_kind": decision.content,
            "specroute.pool": decision.pool,
            "specroute.reason": decision.reason,
            "specroute.ttft_predicted_seconds": decision.predicted_ttft,
        }
    if done.backend is not None:
        found["specroute.backend"] = done.backend.name
        acceptance = done.backend.engine.acceptance
        if acceptance is not None and done.accept_length is not None:  # a figure still in use
            found["specroute.spec.acceptance_ratio"] = acceptance.ratio
    return {key: value for key, value in found.items() if value is not None}
