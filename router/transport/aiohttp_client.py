"""`AiohttpTransport`: the engine client, over aiohttp's (one session, one connection pool per
router). aiohttp's exceptions become the router's in exactly one place, `_translate`.

Interim answers never reach the router: aiohttp reads past any 100–199 but 101, and a 101 is
refused here. The transport never sends a request twice: aiohttp re-sends only idempotent
methods, never a POST; `NotSent` tells the router when a request provably never left. An answer
whose `X-Request-Id` is not the one sent is `WrongAnswer`, and its connection is closed.
"""

from __future__ import annotations

import functools
import io
import ssl
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Sequence

import aiohttp
from yarl import URL

from router.transport.aiohttp_private import KEEP_ALIVE_SECONDS, Connector, discard_connection
from router.transport.base import (
    ConnectError,
    HeadLimits,
    NotSent,
    ReadTimeout,
    RemoteProtocolError,
    Response,
    Timeouts,
    TlsError,
    TooLarge,
    TransportError,
    WrongAnswer,
)

# Connections per origin beyond the requests admitted to it: the scraper, the health check and
# /v1/models each hold one at most.
_PROBE_CONNECTIONS = 3
_ONE_WRITE = 1 << 20
# For the probes' GETs, whose callers bound them with `asyncio.timeout`.
_UNBOUNDED = Timeouts(connect=None, read=None, idle=None)


class _AiohttpResponse:
    def __init__(
        self,
        transport: AiohttpTransport,
        session: aiohttp.ClientSession,
        response: aiohttp.ClientResponse,
        idle: float | None,
    ) -> None:
        self._transport = transport
        self._session = session
        transport.opened(session)
        self._closed = False
        self._response = response
        self.status = response.status
        self.headers: Sequence[tuple[bytes, bytes]] = response.raw_headers
        connection = response.connection
        if connection is not None and connection.protocol is not None:
            # The read timeout covered the wait for the head; from here silence is measured
            # against the idle timeout (the next request on the connection sets its own).
            connection.protocol.read_timeout = idle
            connection.protocol.start_timeout()

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    async def iter_raw(self) -> AsyncIterator[bytes]:
        content = self._response.content
        try:
            while chunk := await content.readany():
                yield chunk
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _translate(exc) from exc

    async def read(self, *, limit: int) -> bytes:
        declared = self._response.content_length
        if declared is not None and declared > limit:
            raise TooLarge(f"the response body ({declared} bytes) is over the {limit} byte limit")
        chunks, size = [], 0
        async for chunk in self.iter_raw():
            size += len(chunk)
            if size > limit:
                raise TooLarge(f"the response body is over the {limit} byte limit")
            chunks.append(chunk)
        return b"".join(chunks)

    async def aclose(self) -> None:
        if self._response.content.is_eof():
            self._response.release()
        else:
            self._response.close()
        if not self._closed:
            self._closed = True
            await self._transport.closed(self._session)


class _BareDelete(aiohttp.ClientRequest):
    """aiohttp's request, except that a DELETE without a body goes without one: aiohttp gives it
    `Content-Length: 0`, a length the client never sent (GET and HEAD it already leaves bare)."""

    GET_METHODS = aiohttp.ClientRequest.GET_METHODS | {"DELETE"}  # what is sent bare when `data` is None


class AiohttpTransport:
    """One aiohttp session for everything the router sends to the engines."""

    def __init__(self, *, connections_per_origin: int, tls: ssl.SSLContext) -> None:
        self._open: Counter[aiohttp.ClientSession] = Counter()  # responses handed out, not yet closed
        self._retired: set[aiohttp.ClientSession] = set()  # replaced by a reload; closed once nothing of theirs is open
        self._limit = 0
        self._session: aiohttp.ClientSession | None = None
        self.configure(connections_per_origin=connections_per_origin, tls=tls)

    @property
    def in_use(self) -> int:
        """Responses handed out and not yet closed."""
        return self._open.total()

    def configure(self, *, connections_per_origin: int, tls: ssl.SSLContext) -> None:
        # The TLS context goes with each request: connections made with another one are pooled apart.
        self.tls = tls
        limit = connections_per_origin + _PROBE_CONNECTIONS
        if limit != self._limit:
            # aiohttp cannot change a connector's cap: requests under way finish on the old
            # session, closed once they have; new ones use a new session.
            if self._session is not None:
                self._retired.add(self._session)
            self._limit = limit
            self._session = None  # made on first use, inside the running event loop

    def opened(self, session: aiohttp.ClientSession) -> None:
        self._open[session] += 1

    async def closed(self, session: aiohttp.ClientSession) -> None:
        self._open[session] -= 1
        if not self._open[session]:
            del self._open[session]
            await self._close_retired()

    async def _close_retired(self) -> None:
        for session in [session for session in self._retired if not self._open[session]]:
            self._retired.discard(session)
            await session.close()

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = Connector(limit=0, limit_per_host=self._limit, keepalive_timeout=KEEP_ALIVE_SECONDS)
            self._session = aiohttp.ClientSession(
                connector=connector,
                request_class=_BareDelete,
                timeout=aiohttp.ClientTimeout(total=None),
                # Only the headers the router chose; aiohttp adds Host and Content-Length.
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
                auto_decompress=True,
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        return self._session

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
        if self._retired:
            await self._close_retired()  # those a reload left with nothing under way
        session = self._client()
        try:
            response = await session.request(
                method,
                URL(base + target, encoded=True),
                headers=list(headers),
                data=_payload(body) if body or method == "POST" else None,
                allow_redirects=False,
                ssl=self.tls,
                timeout=_client_timeout(timeouts.connect, timeouts.read),
                max_line_size=limits.head_bytes,
                max_field_size=limits.head_bytes,
                max_headers=limits.headers,
            )
        except (TimeoutError, aiohttp.ClientError) as exc:
            if _never_written(exc) and len(body) <= _ONE_WRITE:
                raise NotSent("the engine closed the connection before the request was written on it") from exc
            raise _translate(exc) from exc
        if response.status == 101:
            response.close()
            raise RemoteProtocolError("the engine switched protocols (101) on a request that asked for none")
        if _names_another_request(headers, response.raw_headers):
            discard_connection(response)
            raise WrongAnswer("the engine's answer names another request in its X-Request-Id")
        head = len(response.reason or "") + sum(len(name) + len(value) + 4 for name, value in response.raw_headers)
        if head > limits.head_bytes:
            response.close()
            raise TooLarge(f"the response head is over the {limits.head_bytes} byte limit")
        return _AiohttpResponse(self, session, response, timeouts.idle)

    async def get(self, url: str, *, headers: Sequence[tuple[str, str]] = ()) -> tuple[int, bytes]:
        """With an `X-Request-Id` of its own, like a proxied request: an engine that echoes it
        sends it with a copy of this answer sent unasked later, so the request that such a copy
        lands on sees that it is not its answer (id-less, the copies of these GETs' answers were
        read as answers to POSTs). Answered with another request's answer, the GET is sent once
        more, on another connection: it is idempotent."""
        parsed = URL(url, encoded=True)
        try:
            return await self._get_once(parsed, headers)
        except WrongAnswer:
            return await self._get_once(parsed, headers)

    async def _get_once(self, url: URL, headers: Sequence[tuple[str, str]]) -> tuple[int, bytes]:
        response = await self.request(
            str(url.origin()),
            url.raw_path_qs,
            method="GET",
            headers=[*headers, ("x-request-id", uuid.uuid4().hex)],
            timeouts=_UNBOUNDED,
            limits=HeadLimits(head_bytes=64 * 1024, headers=100),
        )
        try:
            return response.status, await response.read(limit=64 * 1024 * 1024)
        finally:
            await response.aclose()

    async def aclose(self) -> None:
        sessions = [*self._retired, *([self._session] if self._session is not None else [])]
        self._retired, self._session = set(), None
        for session in sessions:
            await session.close()


def _names_another_request(sent: Sequence[tuple[str, str]], received: Sequence[tuple[bytes, bytes]]) -> bool:
    request_id = next((value.encode() for name, value in sent if name == "x-request-id"), None)  # as aiohttp wrote it
    if request_id is None:
        return False
    return any(value != request_id for name, value in received if name.lower() == b"x-request-id")


def _payload(body: bytes) -> bytes | io.BytesIO:
    # aiohttp writes a `bytes` body in one go, and warns past 1 MiB; a BytesIO goes in pieces.
    return body if len(body) <= _ONE_WRITE else io.BytesIO(body)


@functools.lru_cache(maxsize=64)
def _client_timeout(connect: float | None, read: float | None) -> aiohttp.ClientTimeout:
    # A handful of distinct values in a router's life: made once each, not per request.
    return aiohttp.ClientTimeout(total=None, connect=connect, sock_read=read)


def _never_written(exc: BaseException) -> bool:
    """Whether the request was refused before a byte of it was written (the engine had closed the
    pooled connection): then the engine cannot have read it. A body of up to `_ONE_WRITE` bytes
    goes out in one write with the head; bytes written and then a closed connection prove nothing."""
    return isinstance(exc, aiohttp.ClientConnectionResetError) or isinstance(
        exc.__cause__, aiohttp.ClientConnectionResetError
    )


def _translate(exc: Exception) -> TransportError:
    """The one place where aiohttp's exceptions become the router's."""
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        return TlsError(f"TLS handshake failed: {exc.certificate_error}")
    if isinstance(exc, aiohttp.ClientSSLError):
        return TlsError(f"TLS handshake failed: {exc.os_error}")
    if isinstance(exc, aiohttp.ClientConnectorError):
        return ConnectError(f"cannot connect: {exc.os_error.strerror or exc.os_error}")
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return ConnectError("connecting timed out")
    if isinstance(exc, aiohttp.SocketTimeoutError | TimeoutError):
        return ReadTimeout("no data from the engine within the read timeout")
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return RemoteProtocolError("the engine closed the connection before the response was complete")
    return RemoteProtocolError(f"{type(exc).__name__}: {exc}")
