"""Every override of aiohttp's private internals, in one place (aiohttp is pinned to its minor).

tests/transport/test_aiohttp_private.py fails the day a name relied on here changes. Why each
override exists: docs/architecture.md, "The engine client".
"""

from __future__ import annotations

import functools
import select
import socket
import struct
from typing import Any

import aiohttp
from aiohttp.client_proto import ResponseHandler
from aiohttp.client_reqrep import ConnectionKey
from aiohttp.connector import Connection
from aiohttp.tracing import Trace

# Uvicorn (under vLLM and SGLang) closes a connection idle for 5 s. A pooled connection is
# dropped sooner, so the router does not send a request on one the engine is just closing.
KEEP_ALIVE_SECONDS = 4.0
_TIMER_SLACK = 0.001  # an event loop may run a timer this much early (its clock's resolution)
_PEER_SHUT = getattr(select, "POLLRDHUP", 0)  # Linux: the peer shut down its side
# Linux's `struct tcp_info` (linux/tcp.h): `tcpi_last_data_recv`, milliseconds since data last
# arrived, is the u32 at this offset. Elsewhere there is no such option: -1 is refused.
_TCP_INFO = getattr(socket, "TCP_INFO", -1)
_LAST_DATA_RECV = 52


class Handler(ResponseHandler):
    """aiohttp's protocol for one connection, with two costs per streamed chunk taken out: one
    read timer per timeout period instead of one per chunk, and no parser run on no data."""

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


class Connector(aiohttp.TCPConnector):
    """aiohttp's connector, refusing to reuse a pooled connection that the engine closed or sent
    anything on while it was idle, or that has been idle past `KEEP_ALIVE_SECONDS` by the
    kernel's clock."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        handler: type[ResponseHandler] = Handler
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


def discard_connection(response: aiohttp.ClientResponse) -> None:
    """Close the connection a response came on, even one aiohttp already put back in its pool:
    it does so as soon as a body has wholly arrived, before the caller sees the head."""
    response.close()
    protocol = response._protocol  # kept after the release (aiohttp is pinned to its minor)
    if protocol is not None:
        protocol.close()
