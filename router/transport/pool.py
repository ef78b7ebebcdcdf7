"""`ConnectionPool`: the engine connections per origin, kept alive between requests, at most
`cap` open per origin (a request over it waits for one, within its connect timeout).

A pooled connection is handed out only after a look at its socket: one the engine closed, sent
anything on while it was idle, or has been silent on past `KEEP_ALIVE_SECONDS` by the kernel's
clock is closed instead (docs/architecture.md, "The engine client").
"""

from __future__ import annotations

import asyncio
import select
import socket
import ssl
import struct
from collections import deque
from dataclasses import dataclass, field

from router.transport.base import ConnectError, TlsError
from router.transport.connection import EngineConnection

# Uvicorn (under vLLM and SGLang) closes a connection idle for 5 s. A pooled connection is
# dropped sooner, so the router does not send a request on one the engine is just closing.
KEEP_ALIVE_SECONDS = 4.0
_PEER_SHUT = getattr(select, "POLLRDHUP", 0)  # Linux: the peer shut down its side
# Linux's `struct tcp_info` (linux/tcp.h): `tcpi_last_data_recv`, milliseconds since data last
# arrived, is the u32 at this offset. Elsewhere there is no such option: -1 is refused.
_TCP_INFO = getattr(socket, "TCP_INFO", -1)
_LAST_DATA_RECV = 52


@dataclass(frozen=True, slots=True)
class Origin:
    host: str
    port: int
    tls: ssl.SSLContext | None  # connections made with another context are pooled apart


@dataclass(slots=True)
class _Connections:
    open: int = 0  # connecting, in use or idle
    idle: list[EngineConnection] = field(default_factory=list)
    waiting: deque[asyncio.Future[None]] = field(default_factory=deque)


class ConnectionPool:
    def __init__(self, cap: int) -> None:
        self.cap = cap  # connections per origin
        self._origins: dict[Origin, _Connections] = {}
        self._of: dict[EngineConnection, Origin] = {}

    async def connection(self, origin: Origin, *, within: float | None) -> EngineConnection:
        """A connection to `origin`, pooled if one is fit to use, else new; ConnectError (or
        TlsError) when none is had `within` seconds."""
        connections = self._origins.get(origin)
        if connections is None:
            connections = self._origins[origin] = _Connections()
        while connections.idle:
            connection = connections.idle.pop()
            if _reusable(connection):
                return connection
            connection.close()
        try:
            async with asyncio.timeout(within):
                while connections.open >= self.cap:
                    await self._wait(connections)
                    while connections.idle:
                        connection = connections.idle.pop()
                        if _reusable(connection):
                            return connection
                        connection.close()
                connections.open += 1
                try:
                    return await self._connect(origin)
                except BaseException:
                    connections.open -= 1
                    self._wake(connections)
                    raise
        except TimeoutError as exc:
            raise ConnectError("connecting timed out") from exc

    async def _wait(self, connections: _Connections) -> None:
        waiter = asyncio.get_running_loop().create_future()
        connections.waiting.append(waiter)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self._wake(connections)  # a turn given to this one: to the next
            else:
                connections.waiting.remove(waiter)
            raise

    def _wake(self, connections: _Connections) -> None:
        while connections.waiting:
            waiter = connections.waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def _connect(self, origin: Origin) -> EngineConnection:
        loop = asyncio.get_running_loop()
        try:
            _, connection = await loop.create_connection(
                lambda: EngineConnection(loop, self._released, self._lost),
                origin.host,
                origin.port,
                ssl=origin.tls,
                server_hostname=origin.host if origin.tls is not None else None,
            )
        except ssl.SSLError as exc:
            raise TlsError(f"TLS handshake failed: {exc}") from exc
        except OSError as exc:
            raise ConnectError(f"cannot connect: {exc.strerror or exc}") from exc
        if connection.transport is None:  # lost before it was counted in: counted out by the caller
            raise ConnectError("the engine closed the connection as it opened")
        self._of[connection] = origin
        return connection

    def _released(self, connection: EngineConnection, reusable: bool) -> None:
        origin = self._of.get(connection)
        connections = self._origins.get(origin) if origin is not None else None
        if connections is None or not reusable:
            return  # closing: `_lost` counts it out
        connection.keep_alive(KEEP_ALIVE_SECONDS)
        connections.idle.append(connection)
        self._wake(connections)

    def _lost(self, connection: EngineConnection) -> None:
        origin = self._of.pop(connection, None)
        connections = self._origins.get(origin) if origin is not None else None
        if connections is None:
            return
        if connection in connections.idle:
            connections.idle.remove(connection)
        connections.open -= 1
        self._wake(connections)
        if not connections.open and not connections.waiting:
            del self._origins[origin]  # type: ignore[arg-type]  # not None: found above

    def close_idle(self, keep: ssl.SSLContext | None = None) -> None:
        """Close the idle connections, all of them or those made with another TLS context than `keep`."""
        for origin, connections in list(self._origins.items()):
            if keep is None or (origin.tls is not None and origin.tls is not keep):
                for connection in connections.idle[:]:
                    connection.close()

    async def aclose(self) -> None:
        for connection in list(self._of):
            connection.close()
        await asyncio.sleep(0)  # the transports' connection_lost


def _reusable(connection: EngineConnection) -> bool:
    """Whether an idle connection's socket has nothing to read (EOF, a reset, or bytes unasked)
    and heard from the engine less than `KEEP_ALIVE_SECONDS` ago, as the kernel counts."""
    transport = connection.transport
    if transport is None or transport.is_closing():
        return False
    sock = transport.get_extra_info("socket")
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
