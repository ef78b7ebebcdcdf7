"""`EngineClient`: the router's one HTTP/1.1 client to the engines, on asyncio protocol callbacks
with llhttp (httptools) parsing the responses (router.transport.connection), over a keep-alive
pool (router.transport.pool).

Interim answers (100–199 but 101) never reach the router, and a 101 is refused. The client never
sends a request twice; `NotSent` tells the router when a request provably never left. An answer
whose `X-Request-Id` is not the one sent is `WrongAnswer`, and its connection is closed.
"""

from __future__ import annotations

import functools
import ssl
import uuid
from collections.abc import Sequence
from urllib.parse import urlsplit

from router.transport.base import (
    GET_LIMIT,
    HeadLimits,
    NotSent,
    RemoteProtocolError,
    Response,
    Timeouts,
    TransportError,
)
from router.transport.pool import ConnectionPool, Origin
from router.transport.response import EngineResponse

# Connections per origin beyond the requests admitted to it: the scraper, the health check and
# /v1/models each hold one at most.
_PROBE_CONNECTIONS = 3
# For the probes' GETs, whose callers bound them with `asyncio.timeout`.
_UNBOUNDED = Timeouts(connect=None, read=None, idle=None)
_PROBE_LIMITS = HeadLimits(head_bytes=64 * 1024, headers=100)


class EngineClient:
    """One connection pool for everything the router sends to the engines."""

    def __init__(self, *, connections_per_origin: int, tls: ssl.SSLContext) -> None:
        self._pool = ConnectionPool(connections_per_origin + _PROBE_CONNECTIONS)
        self._open: set[EngineResponse] = set()  # handed out, not yet closed
        self.tls = tls

    @property
    def in_use(self) -> int:
        """Responses handed out and not yet closed."""
        return len(self._open)

    def configure(self, *, connections_per_origin: int, tls: ssl.SSLContext) -> None:
        self._pool.cap = connections_per_origin + _PROBE_CONNECTIONS
        if tls is not self.tls:
            self._pool.close_idle(keep=tls)  # made with the old context: not used again
        self.tls = tls

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
        scheme, host, port, host_header = _origin(base)
        origin = Origin(host, port, self.tls if scheme == "https" else None)
        head = _head(method, target, host_header, headers, body)
        connection = await self._pool.connection(origin, within=timeouts.connect)
        transport = connection.transport
        if transport is None or transport.is_closing():
            connection.close()
            raise NotSent("the engine closed the connection before the request was written on it")
        response = EngineResponse(connection, self._open.discard)
        self._open.add(response)
        request_id = next((value.encode() for name, value in headers if name == "x-request-id"), None)
        connection.send(
            [head, body],
            response,
            limits=limits,
            read_timeout=timeouts.read,
            idle_timeout=timeouts.idle,
            request_id=request_id,
            head_only=method == "HEAD",
        )
        try:
            await response.started()
        except BaseException:
            await response.aclose()
            raise
        return response

    async def get(
        self, url: str, *, headers: Sequence[tuple[str, str]] = (), limit: int = GET_LIMIT
    ) -> tuple[int, bytes]:
        """With an `X-Request-Id` of its own, like a proxied request: an engine that echoes it
        sends it with a copy of this answer sent unasked later, so the request that such a copy
        lands on sees that it is not its answer. A GET is idempotent: one that fails on the
        connection (another request's answer, a connection the engine closed as it went out)
        is sent once more, on another connection."""
        parts = urlsplit(url)
        base = f"{parts.scheme}://{parts.netloc}"
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        try:
            return await self._get_once(base, target, headers, limit)
        except (NotSent, RemoteProtocolError):  # WrongAnswer among them
            return await self._get_once(base, target, headers, limit)

    async def _get_once(
        self, base: str, target: str, headers: Sequence[tuple[str, str]], limit: int
    ) -> tuple[int, bytes]:
        response = await self.request(
            base,
            target,
            method="GET",
            headers=[*headers, ("x-request-id", uuid.uuid4().hex)],
            timeouts=_UNBOUNDED,
            limits=_PROBE_LIMITS,
        )
        try:
            return response.status, await response.read(limit=limit)
        finally:
            await response.aclose()

    async def aclose(self) -> None:
        await self._pool.aclose()


@functools.lru_cache(maxsize=256)
def _origin(base: str) -> tuple[str, str, int, str]:
    """(scheme, host, port, Host header) of an engine's root URL; a handful in a router's life."""
    parts = urlsplit(base)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        raise TransportError(f"not an http(s) URL: {base!r}")
    default = 443 if scheme == "https" else 80
    port = parts.port or default
    host = parts.hostname
    shown = f"[{host}]" if ":" in host else host
    return scheme, host, port, shown if port == default else f"{shown}:{port}"


def _head(method: str, target: str, host: str, headers: Sequence[tuple[str, str]], body: bytes) -> bytes:
    lines = [f"{method} {target} HTTP/1.1\r\nHost: {host}\r\n"]
    for name, value in headers:
        if "\n" in value or "\r" in value or "\n" in name or "\r" in name:
            raise ValueError(f"a line break in the header field {name!r}")
        lines.append(f"{name}: {value}\r\n")
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}\r\n")
    lines.append("\r\n")
    text = "".join(lines)
    try:
        return text.encode("latin-1")  # as the client's bytes were decoded
    except UnicodeEncodeError:
        return text.encode()
