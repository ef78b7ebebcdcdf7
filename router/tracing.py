"""What the request path asks of a tracer: a span per request, its headers for the engine, its end.

The OpenTelemetry tracer (router.otel, `specroute[otel]`) is loaded only when `tracing.enabled`
is set; without it the request path holds None and does nothing more.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from router.request.incoming import Arrival
    from router.request.observe import Finished

# The W3C Trace Context headers: a client's are continued, and replaced by the router's own upstream.
TRACE_HEADERS = frozenset({"traceparent", "tracestate"})


class RequestSpan(Protocol):
    def upstream_headers(self) -> list[tuple[str, str]]:
        """`traceparent` (and `tracestate`) for the engine: its spans join the trace under this one."""
        ...

    def end(self, done: Finished) -> None:
        """The request's end: its decision and outcome become the span's attributes."""
        ...


class Tracer(Protocol):
    def start(self, arrival: Arrival, age: float) -> RequestSpan:
        """A span for a request that arrived `age` seconds ago (it starts then), continuing the
        trace its headers name, if any."""
        ...

    async def aclose(self) -> None:
        """Send the spans still queued, then stop."""
        ...
