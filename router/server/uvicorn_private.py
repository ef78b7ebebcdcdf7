"""`ClientProtocol`: uvicorn's httptools protocol, subclassed to hold clients to the router's
limits before a request reaches the app (head size and fields, head and write timeouts, the
connection cap), each refusal answered in OpenAI's error shape; and `ClientStream`, through
which a stream's body pieces go straight to the client's connection. It is the one place that
touches uvicorn's internals (uvicorn is pinned to its minor); tests/server/test_uvicorn_private.py
fails the day a name relied on here changes. Why: docs/architecture.md, "The listener".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle

from router.errors import BadRequest, HeadersTooLarge, NoBackendAvailable, RequestTimeout, RouterError
from router.replies import error_response

logger = logging.getLogger("specroute")

# After answering a refusal, the client may still be sending (the rest of a huge head, a body):
# closing a socket with unread data makes the kernel reset the connection, which can destroy the
# answer before the client reads it. So, like nginx's lingering close, the router stops writing,
# reads and drops for at most this long, and then closes.
_LINGER_SECONDS = 2.0

# What the router keeps for a client beyond what the client's kernel has taken: at most this
# much unsent in the kernel (TCP_NOTSENT_LOWAT), nothing in the loop's buffer. Past it, writing
# pauses and `timeouts.client_write` runs, so a client that stops reading is found as soon as its
# receive buffer is full, not after the megabytes a loopback or LAN socket's send buffer holds.
_UNSENT_BYTES = 16 * 1024

# The ASGI extension under which a request's scope carries its `ClientStream`.
CLIENT_STREAM = "specroute.client_stream"


@dataclass(frozen=True, slots=True)
class ClientLimits:
    head_bytes: int
    head_fields: int
    head_seconds: float  # to receive a request's head, or a first byte on a new connection
    write_seconds: float  # that a client may leave the router's data untaken
    max_connections: int


class ClientProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the client limits (`client_limits`, set by `uvicorn_config`)."""

    client_limits: ClientLimits

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._in_head = False  # between the first byte of a request and the end of its head
        self._messages = 0  # requests begun on this connection
        self._head_parsed = 0  # bytes of the head's target and fields, as parsed
        self._head_received = 0  # bytes of reads that held nothing but this head (see data_received)
        self._head_fields = 0
        self._refusal: RouterError | None = None  # raised in a parser callback, answered after it
        self._refused = False
        self.flow_listener: Callable[[bool], None] | None = None  # hears writing pause (True) and resume
        self.lost_listener: Callable[[], None] | None = None  # hears the connection close

    # -- the connection ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        with contextlib.suppress(OSError, AttributeError):  # not TCP (a Unix socket): the loop's buffer only
            transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, _UNSENT_BYTES)
        transport.set_write_buffer_limits(high=0)  # any byte the kernel did not take pauses writing
        if len(self.connections) > self.client_limits.max_connections:
            # Refused before anything is parsed: the descriptor is back within _LINGER_SECONDS.
            cap = self.client_limits.max_connections
            logger.warning("refused a client connection: limits.max_connections (%d) are open", cap)
            error = NoBackendAvailable(
                f"the router has {cap} client connections open; try again", code="too_many_connections"
            )
            self._refuse(error)
            return
        # A connection that never sends a request is closed like a head that never ends.
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)
        listener, self.lost_listener = self.lost_listener, None
        if listener is not None:
            listener()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # lingering after a refusal: read and dropped
        self._unset_keepalive_if_required()
        whole_read_was_head = self._in_head
        messages = self._messages
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._refuse(self._refusal or BadRequest(f"invalid HTTP request: {exc}", code="invalid_request"))
            return
        except httptools.HttpParserUpgrade:  # not reached: upgrades are refused when their head ends
            self._refuse(_upgrade_refused())
            return
        # httptools holds an unfinished header in memory and tells nothing until it ends, so a
        # head that is still arriving is measured by the reads that held only it.
        if whole_read_was_head and self._in_head and messages == self._messages:
            self._head_received += len(data)
            if self._head_received > self.client_limits.head_bytes:
                self._refuse(self._head_too_large())

    # -- the parser's callbacks ------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._messages += 1
        self._head_parsed = self._head_received = self._head_fields = 0
        self._arm_head_timer()

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url), fields=0)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4, fields=1)  # ": " and CRLF
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._cancel_head_timer()
        if self.parser.should_upgrade():
            # llhttp hands whatever follows an upgrade request's head (a POST's body, too) to
            # the new protocol, never to the request: answered, not half-read.
            self._fail(_upgrade_refused())
        super().on_headers_complete()
        cycle = self.cycle  # made just now for this request
        if cycle is not None:
            extensions: dict[str, Any] = cycle.scope.setdefault("extensions", {})
            extensions[CLIENT_STREAM] = ClientStream(self, cycle)

    def _count_head(self, size: int, *, fields: int) -> None:
        self._head_parsed += size
        self._head_fields += fields
        if self._head_parsed > self.client_limits.head_bytes or self._head_fields > self.client_limits.head_fields:
            self._fail(self._head_too_large())

    def _fail(self, error: RouterError) -> None:
        """Stop the parser from a callback; `data_received` answers the error."""
        self._refusal = error
        raise error

    def _head_too_large(self) -> RouterError:
        limits = self.client_limits
        return HeadersTooLarge(
            f"the request head is over {limits.head_bytes} bytes or {limits.head_fields} header fields",
            code="request_head_too_large",
        )

    # -- timeouts --------------------------------------------------------------------------

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.client_limits.head_seconds, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._in_head:
            self.transport.close()  # nothing was sent: closed like an idle keep-alive connection
            return
        seconds = self.client_limits.head_seconds
        self._refuse(RequestTimeout(f"request head not received within {seconds:g} s", code="head_timeout"))

    def pause_writing(self) -> None:
        # The client is not taking what the router sends: it has client_write seconds to start again.
        super().pause_writing()
        if self.flow_listener is not None:
            self.flow_listener(True)
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.client_limits.write_seconds, self._write_timed_out)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.flow_listener is not None:
            self.flow_listener(False)
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_timed_out(self) -> None:
        # Abort: a close would wait for the buffered data to be sent. The request then sees its
        # client gone (http.disconnect), exactly as if it had hung up, and its upstream request
        # is cancelled.
        self._write_timer = None
        logger.info("closing a client connection: %g s without taking data", self.client_limits.write_seconds)
        self.transport.abort()

    def _cancel_timers(self) -> None:
        self._cancel_head_timer()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    # -- refusals --------------------------------------------------------------------------

    def _refuse(self, error: RouterError) -> None:
        """Answer `error` (unless a response is under way on this connection) and close."""
        # Not worth more than a debug line each: like other 4xx, a client's mistake (or attack).
        logger.debug("refused a client request: %s %s", error.status_code, error.code)
        self._refused = True
        self._cancel_timers()
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self.transport.close()  # a pipelined request: an answer now would cut into the running one
            return
        self.transport.write(_response_bytes(error, self.server_state.default_headers))
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self.loop.call_later(_LINGER_SECONDS, self.transport.close)
        else:
            self.transport.close()


class ClientStream:
    """A chunked response's body written straight to the client's connection, past uvicorn's ASGI
    `send`: no message, future or task per piece (router.request.relay). Pieces are gathered and
    go out in one write per `flush`; the head and the last part still go through `send`, so that
    uvicorn's own state (a response complete, keep-alive) stays true, but `through` gathers what
    `send` writes with the pieces, so that a head and the pieces already here, or the last pieces
    and the end, leave in one write."""

    __slots__ = ("_cycle", "_out", "_protocol")

    def __init__(self, protocol: ClientProtocol, cycle: RequestResponseCycle) -> None:
        self._protocol = protocol
        self._cycle = weakref.ref(cycle)  # the cycle's scope holds this: no reference cycle
        self._out: list[bytes] = []  # written, not yet flushed

    def ready(self) -> bool:
        """Whether the response has started, chunked, and is neither complete nor its client gone."""
        cycle = self._cycle()
        return (
            cycle is not None
            and cycle.response_started
            and cycle.chunked_encoding is True
            and not cycle.response_complete
            and not cycle.disconnected
        )

    async def through(self, send: Callable[[Any], Awaitable[None]], message: Any) -> None:
        """`send(message)`, what it writes gathered with the pieces until the next `flush`."""
        cycle = self._cycle()
        if cycle is None:
            await send(message)
            return
        transport = cycle.transport
        cycle.transport = _Gathered(transport, self)  # type: ignore[assignment]  # writes and close, as uvicorn uses it
        try:
            await send(message)
        finally:
            cycle.transport = transport

    def write(self, data: bytes) -> None:
        """One chunk of the body, written at the next `flush`."""
        self._out += (b"%x\r\n" % len(data), data, b"\r\n")

    def flush(self) -> None:
        """Write what was gathered, in one write; dropped once the client has gone."""
        out = self._out
        if not out:
            return
        self._out = []
        transport, cycle = self._protocol.transport, self._cycle()
        if cycle is not None and not cycle.disconnected and not transport.is_closing():
            transport.writelines(out)

    @property
    def paused(self) -> bool:
        """The client has not taken what was written: write no more until `listen` hears it resume."""
        return self._protocol.flow.write_paused

    def listen(self, listener: Callable[[bool], None] | None) -> None:
        """`listener(True)` when the client stops taking data, `listener(False)` when it starts again."""
        self._protocol.flow_listener = listener

    def watch(self, listener: Callable[[], None]) -> bool:
        """`listener()` once the client's connection closes, until `unwatch`: what a task waiting
        on `receive` for `http.disconnect` would hear, without the task. The client is read from
        now on, as `receive` would have it, so that its leaving is seen. False: it has gone."""
        cycle = self._cycle()
        if cycle is None or cycle.disconnected or self._protocol.transport.is_closing():
            return False
        self._protocol.flow.resume_reading()
        self._protocol.lost_listener = listener
        return True

    def unwatch(self, listener: Callable[[], None]) -> None:
        if self._protocol.lost_listener is listener:
            self._protocol.lost_listener = None


class _Gathered:
    """A cycle's transport while `ClientStream.through` runs: writes join the stream's gathered
    pieces; closing writes them first."""

    __slots__ = ("_stream", "_transport")

    def __init__(self, transport: asyncio.Transport, stream: ClientStream) -> None:
        self._transport = transport
        self._stream = stream

    def write(self, data: bytes) -> None:
        self._stream._out.append(data)

    def close(self) -> None:
        self._stream.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def _upgrade_refused() -> RouterError:
    return BadRequest(
        "this router does not switch protocols: send the request without Connection: upgrade",
        code="upgrade_not_supported",
    )


def _response_bytes(error: RouterError, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """A whole HTTP/1.1 response for an error answered by the connection itself, not the app."""
    body = bytes(error_response(error).body)
    headers = [
        *default_headers,
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
        *((name.lower().encode(), value.encode()) for name, value in error.headers().items()),
    ]
    head = b"".join(name + b": " + value + b"\r\n" for name, value in headers)
    return STATUS_LINE[error.status_code] + head + b"\r\n" + body
