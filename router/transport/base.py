"""What the router needs of an HTTP client to the engines: `Transport`, `Response`, the
per-request `Timeouts` and `HeadLimits`, and the one exception tree (named as in HTTPX):

    TransportError
    ├── ConnectError         could not connect (refused, unreachable, connect timeout)
    │   └── TlsError         the TLS handshake failed (an untrusted certificate, a wrong name...)
    ├── NotSent              the engine closed the pooled connection before any byte of the
    │                        request was written on it: the engine cannot have seen the request
    ├── ReadTimeout          no response within the read timeout, or a body silent for the idle timeout
    └── RemoteProtocolError  the connection broke, the response was not HTTP, or was a 101
        ├── TooLarge         a response head or body over its limit (`limits.*`)
        └── WrongAnswer      the response names another request in its `X-Request-Id`
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from router.config import Tls

GET_LIMIT = 64 * 1024 * 1024  # bytes of a GET's body read, unless its caller says less


def tls_context(config: Tls) -> ssl.SSLContext:
    """How engines served over https are checked (`tls` settings; ssl.SSLError if a file is not a
    certificate or key)."""
    context = ssl.create_default_context(cafile=config.ca_bundle)
    if not config.verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if config.client_cert is not None:
        context.load_cert_chain(config.client_cert, config.client_key)
    return context


class TransportError(Exception):
    pass


class ConnectError(TransportError):
    pass


class TlsError(ConnectError):
    pass


class NotSent(TransportError):
    pass


class ReadTimeout(TransportError):
    pass


class RemoteProtocolError(TransportError):
    pass


class TooLarge(RemoteProtocolError):
    pass


class WrongAnswer(RemoteProtocolError):
    pass


@dataclass(frozen=True, slots=True)
class Timeouts:
    connect: float | None  # to have a connection, from the pool or new
    read: float | None  # until the response's head has arrived
    idle: float | None  # silence between pieces of the body, once it has


@dataclass(frozen=True, slots=True)
class HeadLimits:
    head_bytes: int  # status line and headers together
    headers: int  # number of header fields


class Response(Protocol):
    status: int
    headers: Sequence[tuple[bytes, bytes]]  # as the engine sent them

    def header(self, name: bytes) -> bytes | None: ...

    def iter_raw(self) -> AsyncIterator[bytes]:
        """The body (decoded from chunked transfer and any content coding), as it arrives."""
        ...

    async def stream_to(self, sink: Callable[[bytes], None], read: Callable[[], None] | None = None) -> None:
        """Each piece of the body to `sink` as it arrives, in the connection's callbacks (no task
        or future per piece); returns at the end, raises the failure or what `sink` raised.
        `read()` after the pieces already here and after each read of the engine's connection
        that brought pieces (or each piece inflated between reads), except the read that ends the
        body: what `sink` gathered from one read may go on in one write."""
        ...

    def pause_reading(self) -> None:
        """Stop reading the body (whoever takes it is not taking more); silence is then not the engine's."""
        ...

    def resume_reading(self) -> None: ...

    async def read(self, *, limit: int) -> bytes:
        """The whole body; TooLarge, without reading on, once it is over `limit` bytes."""
        ...

    async def aclose(self) -> None:
        """Give the connection back if the body was read to the end; else close it."""
        ...


class Transport(Protocol):
    async def request(
        self,
        base: str,
        target: str,
        *,
        method: str = "POST",
        headers: Sequence[tuple[str, str]],
        body: bytes = b"",
        timeouts: Timeouts,
        limits: HeadLimits,
    ) -> Response:
        """Send a request to `base` (an engine's root URL); return once the response's head has
        arrived. `target` (path and query) goes on the request line byte for byte: nothing
        re-encodes or normalises it. An `x-request-id` among `headers` (lower-case) is the one
        the answer must echo, if it echoes one."""
        ...

    async def get(
        self, url: str, *, headers: Sequence[tuple[str, str]] = (), limit: int = GET_LIMIT
    ) -> tuple[int, bytes]:
        """A small GET (health, metrics, models): its status and whole body, TooLarge past
        `limit` bytes. The caller bounds its time (`asyncio.timeout`)."""
        ...

    tls: ssl.SSLContext

    def configure(self, *, connections_per_origin: int, tls: ssl.SSLContext) -> None:
        """(Re)loaded settings: the connection cap per origin and how engines' certificates are checked."""
        ...

    async def aclose(self) -> None: ...
