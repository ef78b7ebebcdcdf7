"""`EngineConnection`: one HTTP/1.1 connection to an engine, on asyncio protocol callbacks, its
responses parsed by llhttp (httptools). It carries one exchange at a time and tells that
exchange's `Receiver` the head, each body piece as llhttp hands it over, and the end or the
failure: no task, future or stream reader per piece.

A connection is clean, and may carry another request, only once its response was wholly and
cleanly parsed with nothing after it. A byte past a response's end, or one that arrives while
the connection waits in the pool, closes it: whatever it is, it is nobody's answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol, cast

import httptools

from router.transport.base import HeadLimits, ReadTimeout, RemoteProtocolError, TooLarge, TransportError, WrongAnswer

_CLOSED_EARLY = "the engine closed the connection before the response was complete"
_TIMER_SLACK = 0.001  # an event loop may run a timer this much early (its clock's resolution)

# What a connection is doing.
_IDLE = 0  # in the pool: no exchange
_HEAD = 1  # a request sent, its response's head not yet all here
_BODY = 2  # the head handed over, the body arriving
_DONE = 3  # the response wholly parsed, within the read that ended it


class Receiver(Protocol):
    """Hears one exchange on a connection, in order: `head`, any `piece`s, then `end` or `failed`;
    and `read_done` after each read of the connection that reached it."""

    def head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None: ...

    def piece(self, data: bytes) -> None: ...

    def end(self) -> None: ...

    def read_done(self) -> None:
        """A read of the connection is over: all it brought was handed over."""

    def failed(self, exc: TransportError) -> None: ...


class _Stray(Exception):
    """Bytes after the response's end: raised from a parser callback to stop the parser there."""


class EngineConnection(asyncio.Protocol):
    """One connection; `released(self, reusable)` hears when an exchange is over, `lost(self)`
    when the connection has closed."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        released: Callable[[EngineConnection, bool], None],
        lost: Callable[[EngineConnection], None],
    ) -> None:
        self._loop = loop
        self._released = released
        self._lost = lost
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._state = _IDLE
        self._receiver: Receiver | None = None
        self._error: TransportError | None = None  # raised in a parser callback, reported after it
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_parsed = 0  # bytes of the head's reason and fields, as parsed
        self._head_received = 0  # bytes of reads that held nothing but this head
        self._interim = False  # the message being parsed is a 1xx
        self._until_close = False  # the body ends with the connection
        self._keep = False  # may carry another request once this response ends
        self._paused = False
        self._limits = HeadLimits(head_bytes=0, headers=0)
        self._request_id: bytes | None = None
        self._head_only = False  # the request was a HEAD: the response has no body
        self._idle_timeout: float | None = None
        self._idle_seconds = 0.0  # `_idle_timeout`, where it is set (read per piece: no None to test)
        self._deadline: float | None = None  # the current read, idle or keep-alive deadline
        self._timer: asyncio.TimerHandle | None = None

    # -- the exchange ------------------------------------------------------------------------

    def send(
        self,
        data: list[bytes],
        receiver: Receiver,
        *,
        limits: HeadLimits,
        read_timeout: float | None,
        idle_timeout: float | None,
        request_id: bytes | None,
        head_only: bool,
    ) -> None:
        """Write a request (its head and body as `data`) and parse its response for `receiver`."""
        assert self._state == _IDLE and self.transport is not None
        self._state = _HEAD
        self._receiver = receiver
        self._error = None
        self._interim = self._until_close = False
        self._limits = limits
        self._request_id = request_id
        self._head_only = head_only
        self._idle_timeout = idle_timeout
        self._idle_seconds = idle_timeout or 0.0
        self._set_deadline(read_timeout)
        self.transport.writelines(data)

    def pause(self) -> None:
        """The receiver has enough for now: stop reading (and stop counting silence as the engine's)."""
        if not self._paused and self.transport is not None and self._state == _BODY:
            self._paused = True
            self.transport.pause_reading()
            self._set_deadline(None)

    def resume(self) -> None:
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
            if self._state == _BODY:
                self._set_deadline(self._idle_timeout)

    def close(self) -> None:
        """Close at once (a response abandoned under way, stray bytes, or the pool shutting)."""
        self._receiver = None
        self._state = _IDLE  # what the parser still hands over in this read is nobody's
        if self.transport is not None:
            self.transport.abort()

    # -- the transport's callbacks -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is one, though not by class

    def data_received(self, data: bytes) -> None:
        state = self._state
        if state == _IDLE:
            self.close()  # unasked: a late copy of an answer, or garbage
            return
        if state == _BODY and self._deadline is not None:
            self._deadline = self._loop.time() + self._idle_seconds
        receiver = self._receiver
        try:  # one frame per read: a paced stream's every token is one
            try:
                self._parser.feed_data(data)
            except httptools.HttpParserError as exc:
                if self._state == _DONE:
                    self._keep = False  # the response is whole; what followed it closes the connection
                else:
                    self._fail(self._error or RemoteProtocolError(f"invalid HTTP response ({type(exc).__name__})"))
                    return
            except httptools.HttpParserUpgrade:  # a 101, refused in on_headers_complete first
                self._fail(self._error or RemoteProtocolError("the engine switched protocols"))
                return
            if self._state == _DONE:
                self._finish()
            elif state == _HEAD and self._state == _HEAD:
                # llhttp holds an unfinished header field and tells nothing until it ends: a head
                # still arriving is measured by the reads that held only it.
                self._head_received += len(data)
                if self._head_received > 2 * self._limits.head_bytes:
                    self._fail(self._head_too_large())
        finally:
            if receiver is not None:
                receiver.read_done()

    def eof_received(self) -> bool | None:
        return None  # closes the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        state, receiver = self._state, self._receiver
        self._receiver = None
        self._state = _IDLE
        if receiver is not None:
            if state == _BODY and self._until_close and self._error is None:
                receiver.end()  # a body delimited by the connection's end
            elif state in (_HEAD, _BODY):
                receiver.failed(RemoteProtocolError(_CLOSED_EARLY))
        self.transport = None
        self._lost(self)

    # -- the parser's callbacks -----------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._state != _HEAD:
            raise _Stray
        self._headers = []
        self._head_parsed = self._head_received = 0

    def on_status(self, status: bytes) -> None:
        self._count_head(len(status), fields=0)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))
        self._count_head(len(name) + len(value) + 4, fields=1)  # ": " and CRLF

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            self._interim = True  # 100 Continue, 102, 103 Early Hints: never the answer
            return
        if status == 101:
            self._raise(RemoteProtocolError("the engine switched protocols (101) on a request that asked for none"))
        if self._request_id is not None and any(
            value != self._request_id for name, value in self._headers if name.lower() == b"x-request-id"
        ):
            self._raise(WrongAnswer("the engine's answer names another request in its X-Request-Id"))
        framing = {name.lower() for name, _ in self._headers} & {b"content-length", b"transfer-encoding"}
        if b"transfer-encoding" in framing and not self._chunked():
            # llhttp would read it to the connection's end, undecoded: nothing the router can relay.
            self._raise(RemoteProtocolError("the engine's transfer coding is not chunked"))
        self._until_close = not framing and status not in (204, 304)
        self._keep = self._parser.should_keep_alive()  # once the message is over, llhttp no longer says
        self._state = _BODY
        self._set_deadline(self._idle_timeout)
        receiver = self._receiver
        assert receiver is not None
        receiver.head(status, self._headers)
        if self._head_only:  # llhttp cannot be told; the connection is not reused after it
            self._keep = False
            self._state = _DONE

    def _chunked(self) -> bool:
        codings = b",".join(value for name, value in self._headers if name.lower() == b"transfer-encoding")
        return codings.rsplit(b",", 1)[-1].strip().lower() == b"chunked"

    def on_body(self, body: bytes) -> None:
        if self._state == _BODY and self._receiver is not None:
            self._receiver.piece(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        if self._state == _BODY:
            self._state = _DONE

    # -- the end of an exchange ----------------------------------------------------------------

    def _finish(self) -> None:
        receiver, self._receiver = self._receiver, None
        keep = self._keep and not self._until_close
        self._state = _IDLE
        if self._paused:
            self.resume()  # the pool's now: a byte unasked must be seen
        if receiver is not None:
            receiver.end()
        self._released(self, keep)
        if not keep:
            self.close()

    def _fail(self, exc: TransportError) -> None:
        receiver, self._receiver = self._receiver, None
        self._state = _IDLE
        self._cancel_timer()
        if self.transport is not None:
            self.transport.abort()
        if receiver is not None:
            receiver.failed(exc)

    def _count_head(self, size: int, *, fields: int) -> None:
        self._head_parsed += size
        if self._head_parsed > self._limits.head_bytes or len(self._headers) > self._limits.headers:
            self._raise(self._head_too_large())

    def _head_too_large(self) -> TooLarge:
        return TooLarge(f"the response head is over the {self._limits.head_bytes} byte limit")

    def _raise(self, error: TransportError) -> None:
        """Stop the parser from a callback; `data_received` reports the error."""
        self._error = error
        raise error

    # -- timers ----------------------------------------------------------------------------------

    def keep_alive(self, seconds: float) -> None:
        """In the pool: closed once idle for `seconds`."""
        self._set_deadline(seconds)

    def _set_deadline(self, seconds: float | None) -> None:
        if seconds is None:
            self._deadline = None
            self._cancel_timer()
            return
        self._deadline = deadline = self._loop.time() + seconds
        timer = self._timer
        if timer is not None and timer.when() > deadline:
            timer.cancel()  # a shorter timeout than the one the timer was set for
            timer = None
        if timer is None:
            self._timer = self._loop.call_at(deadline, self._on_timer)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timer(self) -> None:
        # One timer per timeout period, not one per piece: moved on when data came meanwhile.
        self._timer = None
        deadline = self._deadline
        if deadline is None:
            return
        if self._loop.time() < deadline - _TIMER_SLACK:
            self._timer = self._loop.call_at(deadline, self._on_timer)
            return
        if self._state == _IDLE:
            self.close()  # idle in the pool past the keep-alive time
        elif self._state == _HEAD:
            self._fail(ReadTimeout("no response from the engine within the read timeout"))
        else:
            self._fail(ReadTimeout("the engine's response went silent for the idle timeout"))
