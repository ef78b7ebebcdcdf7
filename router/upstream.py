"""A small HTTP/1.1 client for the engines, built for one job: streaming responses cheaply.

Measured on this machine (docs/benchmarks.md), httpx's connection pool spends most of a
128-stream burst scanning its connections with a syscall each, and its pure-Python parser costs
more per chunk than the rest of the router together. This client parses with llhttp (httptools,
which uvicorn already brings), keeps idle keep-alive connections on a stack per origin (O(1) to
take and return), and hands body bytes to the caller as the socket delivers them.

    TransportError           (named as in HTTPX)
    ├── ConnectError         could not connect (refused, unreachable, connect timeout)
    ├── ReadTimeout          no response within the read timeout, or a body silent for the idle timeout
    └── RemoteProtocolError  the connection broke or the response was not HTTP
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import AsyncIterator
from typing import cast
from urllib.parse import urlsplit

import httptools

_HIGH_WATER = 1 << 20  # stop reading from the socket when this much body is waiting


class TransportError(Exception):
    pass


class ConnectError(TransportError):
    pass


class ReadTimeout(TransportError):
    pass


class RemoteProtocolError(TransportError):
    pass


class _Connection(asyncio.Protocol):
    """One TCP connection; parses responses into status, headers and a queue of body chunks."""

    def __init__(self, read_timeout: float, idle_timeout: float) -> None:
        self.read_timeout = read_timeout  # until the response starts
        self.idle_timeout = idle_timeout  # between pieces of the body, once it has
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._parser = httptools.HttpResponseParser(self)
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._error: TransportError | None = None
        self._paused = False
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.message_done = False
        self.keep_alive = False
        self.received_any = False

    # -- asyncio.Protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.received_any = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(RemoteProtocolError(f"invalid HTTP response: {exc}"))
            self.close()

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.message_done:
            self._fail(RemoteProtocolError("the engine closed the connection before the response was complete"))

    # -- httptools callbacks --------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.keep_alive = self._parser.should_keep_alive()  # read now: llhttp forgets it later
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > _HIGH_WATER and self.transport is not None and not self._paused:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.message_done = True
        self._wake()

    # -- used by the client ---------------------------------------------------------------

    def reusable(self) -> bool:
        return not self.closed and self.message_done and self.keep_alive

    def reset(self) -> None:
        """Ready for the next request on this keep-alive connection."""
        self._parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers = []
        self.headers_done = self.message_done = self.keep_alive = self.received_any = False

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    async def wait(self) -> None:
        """Until something arrives, the connection fails, or the read timeout passes."""
        if self._error is not None:
            raise self._error
        loop = asyncio.get_running_loop()
        self._waiter = loop.create_future()
        try:
            async with asyncio.timeout(limit := self.idle_timeout if self.headers_done else self.read_timeout):
                await self._waiter
        except TimeoutError as exc:
            raise ReadTimeout(f"no data from the engine within {limit:g} s") from exc
        finally:
            self._waiter = None
        if self._error is not None:
            raise self._error

    def take(self) -> bytes:
        data = b"".join(self._chunks) if len(self._chunks) > 1 else (self._chunks[0] if self._chunks else b"")
        self._chunks.clear()
        self._buffered = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    @property
    def has_body(self) -> bool:
        return bool(self._chunks)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, error: TransportError) -> None:
        if self._error is None:
            self._error = error
        self._wake()


class UpstreamResponse:
    def __init__(self, pool: UpstreamPool, origin: str, connection: _Connection) -> None:
        self._pool = pool
        self._origin = origin
        self._connection = connection
        self.status_code = connection.status
        self.headers = connection.headers
        self._released = False

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    async def iter_raw(self) -> AsyncIterator[bytes]:
        """The body, decoded from chunked transfer, as it arrives."""
        connection = self._connection
        while True:
            if connection.has_body:
                yield connection.take()
                continue
            if connection.message_done:
                return
            await connection.wait()

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.iter_raw()])

    async def aclose(self) -> None:
        """Give the connection back if the response was read to the end; else close it."""
        if self._released:
            return
        self._released = True
        self._pool.in_use -= 1
        connection = self._connection
        if connection.reusable() and not connection.has_body:
            connection.reset()
            self._pool._release(self._origin, connection)
        else:
            connection.close()


class UpstreamPool:
    """Keep-alive connections to every engine, idle ones on a stack per origin."""

    def __init__(
        self,
        *,
        connect_timeout: float,
        read_timeout: float,
        idle_timeout: float | None = None,
        max_idle_per_origin: int = 256,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.idle_timeout = read_timeout if idle_timeout is None else idle_timeout
        self.max_idle = max_idle_per_origin
        self._idle: dict[str, list[_Connection]] = {}
        self.in_use = 0  # responses handed out and not yet closed
        self._tls: ssl.SSLContext | None = None

    async def request(
        self, url: str, *, method: str = "POST", headers: list[tuple[bytes, bytes]], body: bytes = b""
    ) -> UpstreamResponse:
        """Send a request; return once the response's status and headers have arrived."""
        parts = urlsplit(url)
        origin = f"{parts.scheme}://{parts.netloc}"
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        head = [f"{method} {target} HTTP/1.1\r\nhost: {parts.netloc}\r\ncontent-length: {len(body)}\r\n".encode()]
        head.extend(name + b": " + value + b"\r\n" for name, value in headers)
        message = b"".join(head) + b"\r\n" + body

        connection = self._idle_connection(origin)
        if connection is not None:
            try:
                return await self._exchange(origin, connection, message)
            except RemoteProtocolError:
                # The engine may have closed this idle connection just as it was reused; the
                # request did not reach it, so it is safe to send once more on a new one.
                if connection.received_any:
                    raise
        tls = parts.scheme == "https"
        connection = await self._connect(origin, parts.hostname or "127.0.0.1", parts.port or (443 if tls else 80), tls)
        return await self._exchange(origin, connection, message)

    async def get(self, url: str, *, headers: list[tuple[bytes, bytes]] | None = None) -> tuple[int, bytes]:
        response = await self.request(url, method="GET", headers=headers or [])
        try:
            return response.status_code, await response.read()
        finally:
            await response.aclose()

    async def aclose(self) -> None:
        for connections in self._idle.values():
            for connection in connections:
                connection.close()
        self._idle.clear()

    def _idle_connection(self, origin: str) -> _Connection | None:
        stack = self._idle.get(origin)
        while stack:
            connection = stack.pop()
            if not connection.closed:
                return connection
        return None

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    def _release(self, origin: str, connection: _Connection) -> None:
        stack = self._idle.setdefault(origin, [])
        if len(stack) < self.max_idle:
            stack.append(connection)
        else:
            connection.close()

    async def _connect(self, origin: str, host: str, port: int, tls: bool) -> _Connection:
        loop = asyncio.get_running_loop()
        context = self._tls_context() if tls else None
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, connection = await loop.create_connection(
                    lambda: _Connection(self.read_timeout, self.idle_timeout),
                    host,
                    port,
                    ssl=context,
                    server_hostname=host if tls else None,
                )
        except TimeoutError as exc:
            raise ConnectError(f"connecting to {origin} timed out") from exc
        except OSError as exc:
            raise ConnectError(f"cannot connect to {origin}: {exc.strerror or exc}") from exc
        return connection

    async def _exchange(self, origin: str, connection: _Connection, message: bytes) -> UpstreamResponse:
        assert connection.transport is not None
        try:
            connection.transport.write(message)
            while not connection.headers_done:
                await connection.wait()
        except BaseException:
            connection.close()
            raise
        self.in_use += 1
        return UpstreamResponse(self, origin, connection)
