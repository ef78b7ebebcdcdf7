"""The seam between the router and the HTTP client that talks to the engines.

`Transport` is what the proxy, the scraper, the health checks and `/v1/models` use; `AiohttpTransport`
is the one implementation, over aiohttp's client (one session, one connection pool per router).
Tests and the simulator may put another behind the same protocol. aiohttp's exceptions become
the router's in exactly one place, `_translate`:

    TransportError           (named as in HTTPX)
    ├── ConnectError         could not connect (refused, unreachable, connect timeout)
    │   └── TlsError         the TLS handshake failed (an untrusted certificate, a wrong name...)
    ├── NotSent              the engine had closed the pooled connection before any byte of the
    │                        request was written on it: the engine cannot have seen the request
    ├── ReadTimeout          no response within the read timeout, or a body silent for the idle timeout
    └── RemoteProtocolError  the connection broke, the response was not HTTP, or was a 101
        ├── TooLarge         a response head or body over its limit (`limits.*`)
        └── WrongAnswer      the response names another request in its `X-Request-Id`

Interim answers never reach the router: aiohttp reads past any 100–199 but 101
(`ClientResponse.start`), and a 101 is refused here. The transport never sends a request
twice: aiohttp re-sends only idempotent methods (RFC 9112 §9.3.1: the GETs of the health checks,
the scraper and `/v1/models`), never a POST. A retry is the router's decision, counted in
`specroute_retries_total`; `NotSent` tells the router when a request provably never left (see
`_never_written`).

HTTP/1.1 has no other way to tell whose answer a response is than its order on the connection.
Bytes that reach an idle pooled connection make it unusable (`_Connector`), but an answer an
engine sends unasked can also land just after the next request went out on that connection, and
then it reads as that request's answer. An engine that echoes `X-Request-Id` (vLLM with
`--enable-request-id-headers`, the simulator) lets the router see it: a response whose
`X-Request-Id` is not the one sent is `WrongAnswer`, and its connection is closed.
"""

from __future__ import annotations

import functools
import io
import select
import socket
import ssl
import struct
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
from aiohttp.client_proto import ResponseHandler
from aiohttp.client_reqrep import ConnectionKey
from aiohttp.connector import Connection
from aiohttp.tracing import Trace
from yarl import URL

from router.config import Tls

# Uvicorn (under vLLM and SGLang) closes a connection idle for 5 s. A pooled connection is
# dropped sooner, so the router does not send a request on one the engine is just closing.
KEEP_ALIVE_SECONDS = 4.0
# Connections per origin beyond the requests admitted to it: the scraper, the health check and
# /v1/models each hold one at most.
_PROBE_CONNECTIONS = 3
_ONE_WRITE = 1 << 20
_TIMER_SLACK = 0.001  # an event loop may run a timer this much early (its clock's resolution)
_PEER_SHUT = getattr(select, "POLLRDHUP", 0)  # Linux: the peer shut down its side
# Linux's `struct tcp_info` (linux/tcp.h): `tcpi_last_data_recv`, milliseconds since data last
# arrived, is the u32 at this offset. Elsewhere there is no such option: -1 is refused.
_TCP_INFO = getattr(socket, "TCP_INFO", -1)
_LAST_DATA_RECV = 52


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


# For the probes' GETs, whose callers bound them with `asyncio.timeout`.
_UNBOUNDED = Timeouts(connect=None, read=None, idle=None)


class Response(Protocol):
    status: int
    headers: Sequence[tuple[bytes, bytes]]  # as the engine sent them

    def header(self, name: bytes) -> bytes | None: ...

    def iter_raw(self) -> AsyncIterator[bytes]:
        """The body (decoded from chunked transfer and any content coding), as it arrives."""
        ...

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

    async def get(self, url: str, *, headers: Sequence[tuple[str, str]] = ()) -> tuple[int, bytes]:
        """A small GET (health, metrics, models): its status and whole body. The caller bounds
        its time (`asyncio.timeout`)."""
        ...

    tls: ssl.SSLContext

    def configure(self, *, connections_per_origin: int, tls: ssl.SSLContext) -> None:
        """(Re)loaded settings: the connection cap per origin and how engines' certificates are checked."""
        ...

    async def aclose(self) -> None: ...


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


class _Handler(ResponseHandler):
    """aiohttp's protocol for one connection, with two costs per streamed chunk taken out.

    aiohttp 3.14 calls `resume_reading` after every piece of body the reader takes, paused or
    not, and each call runs the parser on no data and resumes the socket again. With one engine
    chunk per read (a paced stream) that came to about a third more CPU per streamed chunk than
    the router's previous client (docs/benchmarks.md §4). When reading was paused (the reader
    fell behind), the call goes through unchanged.

    aiohttp also moves the read timeout on every piece of data by cancelling its timer and
    starting a new one (3.4 µs under uvloop). Here data only moves the deadline; the one timer,
    when it comes, sees whether the deadline has passed and otherwise waits again until it: the
    timeout fires at the same moment, with one timer per timeout period instead of one per chunk.
    """

    _read_deadline = 0.0

    def resume_reading(self, resume_parser: bool = True) -> None:
        if self._reading_paused:
            super().resume_reading(resume_parser)

    def _reschedule_timeout(self) -> None:
        timeout = self._read_timeout
        if not timeout:
            self._drop_timeout()
            return
        self._read_deadline = deadline = self._loop.time() + timeout
        handle = self._read_timeout_handle
        if handle is not None and handle.when() > deadline:
            handle.cancel()  # a shorter timeout than the one the timer was set for
            handle = None
        if handle is None:
            self._read_timeout_handle = self._loop.call_at(deadline, self._read_timer)

    def _read_timer(self) -> None:
        if self._loop.time() >= self._read_deadline - _TIMER_SLACK:
            self._read_timeout_handle = None
            self._on_read_timeout()
        else:  # data came meanwhile
            self._read_timeout_handle = self._loop.call_at(self._read_deadline, self._read_timer)


class _Connector(aiohttp.TCPConnector):
    """aiohttp's connector, refusing to reuse a pooled connection that the engine closed or sent
    anything on while it was idle, or that has been idle for too long by the kernel's clock.

    aiohttp parses and queues a response that arrives on an idle keep-alive connection (a late
    second answer, bytes after a 204) and hands it to the next request sent on that connection
    as its answer. Such a connection is closed instead: those bytes are nobody's answer. So is
    one whose socket polls readable: the engine's FIN, a reset or unasked bytes may be in the
    kernel, not yet read by the loop, and a request written there may or may not have been read
    by the engine. Nothing is awaited between this look and the request's head being written
    (or, with a body on Python 3.11, the task that writes it being started).

    aiohttp counts a connection's idle time from when the loop put it back in the pool, which is
    late by however long the loop was held up when the answer's last byte arrived; the engine
    counts its keep-alive from when it sent that byte. A router whose loop was held up for a
    second could send a request on a connection the engine was closing that instant (seen as
    three requests closed at once on real vLLM engines). So the kernel's own count since the
    last byte arrived (Linux `TCP_INFO`) must be under `KEEP_ALIVE_SECONDS` too.
    """

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        handler: type[ResponseHandler] = _Handler
        self._factory = functools.partial(handler, loop=self._loop)

    async def _get(self, key: ConnectionKey, traces: list[Trace]) -> Connection | None:
        while (connection := await super()._get(key, traces)) is not None:
            protocol: ResponseHandler | None = connection.protocol
            if protocol is not None and not protocol.should_close and _reusable(protocol):
                return connection
            connection.close()
        return None


def _reusable(protocol: ResponseHandler) -> bool:
    """Whether an idle connection's socket has nothing to read (EOF, a reset, or bytes unasked)
    and heard from the engine less than `KEEP_ALIVE_SECONDS` ago, as the kernel counts."""
    if protocol.transport is None:
        return True  # aiohttp itself refuses to write on it
    sock = protocol.transport.get_extra_info("socket")
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN | _PEER_SHUT)
    return not poller.poll(0) and _silent_for(sock) < KEEP_ALIVE_SECONDS


def _silent_for(sock: socket.socket) -> float:
    """Seconds since the last byte from the engine reached `sock`, by the kernel's clock; 0 where
    the kernel does not say (no `TCP_INFO`: not Linux)."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _LAST_DATA_RECV + 4)
    except OSError:
        return 0.0
    milliseconds: int = struct.unpack_from("=I", info, _LAST_DATA_RECV)[0]
    return milliseconds / 1000


class _Request(aiohttp.ClientRequest):
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
            connector = _Connector(limit=0, limit_per_host=self._limit, keepalive_timeout=KEEP_ALIVE_SECONDS)
            self._session = aiohttp.ClientSession(
                connector=connector,
                request_class=_Request,
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
            _discard_connection(response)
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


def _discard_connection(response: aiohttp.ClientResponse) -> None:
    """Close the connection a response came on, even one aiohttp already put back in its pool:
    it does so as soon as a body has wholly arrived, before the caller sees the head."""
    response.close()
    protocol = response._protocol  # kept after the release (aiohttp is pinned to its minor)
    if protocol is not None:
        protocol.close()


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
    """Whether the request was refused before a byte of it was written: its connection was
    closing, or closed by the engine.

    The engine closed a pooled keep-alive connection (uvicorn does after 5 s idle) after the pool
    handed it out but before the request was written: with a body on Python 3.11 the write runs
    in a task of its own, and the loop may read the engine's FIN first (uvloop polls the sockets
    before it runs that task; seconds may pass on a busy machine). aiohttp's writer then raises
    ClientConnectionResetError before a byte reaches the socket; the body writer passes it on as
    the cause of a ClientOSError. A body of up to `_ONE_WRITE`
    bytes goes out in that one write together with the head, so its refusal means that no byte
    left: the engine cannot have read the request (RFC 9110 §9.2.2 allows sending a POST again
    when "the original request was never applied"; Envoy's `reset-before-request` is the same
    case). Bytes written and then a closed connection prove nothing — the engine may have read
    them — and stay a RemoteProtocolError.
    """
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
