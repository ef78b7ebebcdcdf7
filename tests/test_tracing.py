"""Request spans (router.otel) received by a real OTLP/HTTP receiver on loopback, which decodes the
OpenTelemetry protocol's own protobufs; the engine's side seen by a fake engine."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tests.conftest import Cluster
from tests.servers import ServerThread
from tests.wait import wait_until

pytestmark = pytest.mark.e2e

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


class Receiver:
    """An OTLP/HTTP traces endpoint: every span it is sent, with its resource's attributes."""

    def __init__(self) -> None:
        self.spans: list[tuple[Span, dict[str, Any]]] = []
        self._lock = threading.Lock()

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/v1/traces", self._traces, methods=["POST"])])

    async def _traces(self, request: Request) -> Response:
        assert request.headers["content-type"] == "application/x-protobuf"
        export = ExportTraceServiceRequest.FromString(await request.body())
        with self._lock:
            for resource_spans in export.resource_spans:
                resource = _values(resource_spans.resource.attributes)
                for scope in resource_spans.scope_spans:
                    self.spans += [(span, resource) for span in scope.spans]
        return Response(ExportTraceServiceResponse().SerializeToString(), media_type="application/x-protobuf")


def _context(traceparent: str | None) -> tuple[str, str, bool]:
    """(trace id, parent span id, sampled) of a W3C traceparent (version 00)."""
    assert traceparent is not None
    version, trace_id, span_id, flags = traceparent.split("-")
    assert version == "00"
    return trace_id, span_id, bool(int(flags, 16) & 1)


def _values(attributes: Any) -> dict[str, Any]:
    found = {}
    for attribute in attributes:
        value = attribute.value
        found[attribute.key] = getattr(value, value.WhichOneof("value"))
    return found


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, str]]:
    found = Receiver()
    with ServerThread(found.app()) as server:
        yield found, server.url + "/v1/traces"


def _client(cluster: Cluster) -> OpenAI:
    return cluster.client("x")


def _chat(client: OpenAI, *, stream: bool, traceparent: str | None = None) -> None:
    headers = {"traceparent": traceparent} if traceparent else {}
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Write a poem about the sea."}]
    if stream:
        for _ in client.chat.completions.create(
            model="test-model", messages=messages, stream=True, extra_headers=headers
        ):
            pass
    else:
        client.chat.completions.create(model="test-model", messages=messages, extra_headers=headers)


def test_a_span_per_request_with_its_decision_joins_the_clients_trace_and_the_engines(
    receiver: tuple[Receiver, str],
    make_cluster: Callable[..., AbstractContextManager[Cluster]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    found, endpoint = receiver
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # the SDK's own variable: export every 50 ms
    monkeypatch.setenv("OTEL_SERVICE_NAME", "router-a")
    with make_cluster(tracing={"enabled": True, "endpoint": endpoint}) as cluster:
        with _client(cluster) as client:
            _chat(client, stream=True, traceparent=f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")
            _chat(client, stream=False)
        wait_until(lambda: len(found.spans) == 2, message="two spans received")
        streamed, whole = sorted((span for span, _ in found.spans), key=lambda s: s.start_time_unix_nano)
        resource = found.spans[0][1]
        seen = [request.headers.get("traceparent") for request in cluster.fast.requests]
    assert resource["service.name"] == "router-a"
    # The client's trace continues through the router...
    assert streamed.trace_id.hex() == CLIENT_TRACE and streamed.parent_span_id.hex() == CLIENT_SPAN
    assert streamed.name == "POST /v1/chat/completions" and streamed.kind == Span.SPAN_KIND_SERVER
    # ...to the engine, whose spans join it under the router's.
    assert _context(seen[0]) == (CLIENT_TRACE, streamed.span_id.hex(), True)
    # A request without a trace starts one, and hands it on the same way.
    assert whole.parent_span_id == b"" and whole.trace_id.hex() != CLIENT_TRACE
    assert _context(seen[1]) == (whole.trace_id.hex(), whole.span_id.hex(), True)
    attributes = _values(streamed.attributes)
    assert {
        key: attributes[key]
        for key in (
            "specroute.job_class",
            "specroute.content_kind",
            "specroute.pool",
            "specroute.backend",
            "specroute.reason",
            "http.response.status_code",
            "gen_ai.usage.output_tokens",
        )
    } == {
        "specroute.job_class": "interactive",
        "specroute.content_kind": "prose",
        "specroute.pool": "fast",
        "specroute.backend": "fast-1",
        "specroute.reason": "default",
        "http.response.status_code": 200,
        "gen_ai.usage.output_tokens": 8,
    }
    assert attributes["specroute.ttft_predicted_seconds"] >= 0
    assert (
        0 < attributes["specroute.ttft_seconds"] < (streamed.end_time_unix_nano - streamed.start_time_unix_nano) / 1e9
    )
    assert "specroute.ttft_seconds" not in _values(whole.attributes)  # not streamed: no first token of its own


def test_sampling_and_a_broken_traceparent(
    receiver: tuple[Receiver, str],
    make_cluster: Callable[..., AbstractContextManager[Cluster]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    found, endpoint = receiver
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    with make_cluster(tracing={"enabled": True, "endpoint": endpoint, "sample_ratio": 0.0}) as cluster:
        with _client(cluster) as client:
            _chat(client, stream=False)  # a new trace: not sampled
            _chat(client, stream=False, traceparent="00-zzzz-not-a-trace-01")  # read as none
            _chat(client, stream=False, traceparent=f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")  # its parent decides
        seen = [request.headers.get("traceparent") for request in cluster.fast.requests]
    # The router has stopped, and flushed every span it recorded: only the sampled parent's.
    assert [span.trace_id.hex() for span, _ in found.spans] == [CLIENT_TRACE]
    # The engine still gets the router's context, marked not sampled, never the client's garbage.
    for traceparent in seen[:2]:
        trace_id, _, sampled = _context(traceparent)
        assert not sampled and trace_id not in (CLIENT_TRACE, "zzzz")
    assert _context(seen[2])[::2] == (CLIENT_TRACE, True)


def test_without_tracing_a_clients_traceparent_reaches_the_engine_as_it_came(cluster: Cluster) -> None:
    with _client(cluster) as client:
        _chat(client, stream=False, traceparent=f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")
    assert cluster.fast.requests[0].headers["traceparent"] == f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
