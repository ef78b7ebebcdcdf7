"""The engines' HTTP client against raw servers on loopback that send exactly the bytes we choose."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from router.upstream import ConnectError, ReadTimeout, RemoteProtocolError, UpstreamPool

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A server on a free port; yields its URL and the list of connections it accepted."""
    accepted: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        try:
            await handler(reader, writer)
        except (asyncio.CancelledError, asyncio.IncompleteReadError, ConnectionError):
            pass  # the test is over, or the client went away: both are fine for a fixture
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", accepted
    finally:
        server.close()
        await server.wait_closed()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    return head + await reader.readexactly(length)


def _pool(read_timeout: float = 2.0) -> UpstreamPool:
    return UpstreamPool(connect_timeout=1.0, read_timeout=read_timeout)


@pytest.mark.anyio
async def test_chunked_stream_arrives_in_pieces_and_connection_is_reused() -> None:
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(2):
            seen.append(await read_request(reader))
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            for piece in (b"data: 1\n\n", b"data: 2\n\n"):
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                await writer.drain()
                await asyncio.sleep(0.01)
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    async with raw_server(handler) as (url, accepted):
        pool = _pool()
        for _ in range(2):
            response = await pool.request(url + "/v1/x?a=1", headers=[(b"x-test", b"1")], body=b'{"k": 1}')
            assert response.status_code == 200
            assert response.header(b"content-type") == b"text/event-stream"
            pieces = [piece async for piece in response.iter_raw()]
            assert b"".join(pieces) == b"data: 1\n\ndata: 2\n\n"
            assert len(pieces) == 2  # delivered as they came, not gathered
            await response.aclose()
        assert accepted == [1]  # one connection, kept alive
        assert pool.in_use == 0
        await pool.aclose()
    assert seen[0].startswith(b"POST /v1/x?a=1 HTTP/1.1\r\n")
    assert b"x-test: 1\r\n" in seen[0] and seen[0].endswith(b'\r\n\r\n{"k": 1}')


@pytest.mark.anyio
async def test_content_length_body_and_get() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 5\r\n\r\nnope!")
        await writer.drain()

    async with raw_server(handler) as (url, _):
        pool = _pool()
        assert await pool.get(url + "/health") == (404, b"nope!")
        assert pool.in_use == 0
        await pool.aclose()


@pytest.mark.anyio
async def test_connection_closed_mid_body_is_a_protocol_error_after_the_bytes_that_came() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n")
        await writer.drain()

    async with raw_server(handler) as (url, _):
        pool = _pool()
        response = await pool.request(url, headers=[])
        received: list[bytes] = []

        async def drain() -> None:
            async for piece in response.iter_raw():
                received.append(piece)

        with pytest.raises(RemoteProtocolError):
            await drain()
        assert received == [b"data: 1\n\n"]
        await response.aclose()
        assert pool.in_use == 0
        await pool.aclose()


@pytest.mark.anyio
async def test_silence_is_a_read_timeout_before_and_between_chunks() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(5)

    async def stalls(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await writer.drain()
        await asyncio.sleep(5)

    pool = _pool(read_timeout=0.2)
    async with raw_server(silent) as (url, _):
        with pytest.raises(ReadTimeout):
            await pool.request(url, headers=[])
    async with raw_server(stalls) as (url, _):
        response = await pool.request(url, headers=[])
        with pytest.raises(ReadTimeout):
            [piece async for piece in response.iter_raw()]
        await response.aclose()
    assert pool.in_use == 0
    await pool.aclose()


@pytest.mark.anyio
async def test_refused_connection_is_a_connect_error() -> None:
    with socket.socket() as placeholder:
        placeholder.bind(("127.0.0.1", 0))
        port = placeholder.getsockname()[1]
        with pytest.raises(ConnectError):
            await _pool().request(f"http://127.0.0.1:{port}/", headers=[])


@pytest.mark.anyio
async def test_garbage_is_a_protocol_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"SMTP ready\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    async with raw_server(handler) as (url, _):
        with pytest.raises(RemoteProtocolError):
            await _pool().request(url, headers=[])


@pytest.mark.anyio
async def test_abandoned_response_closes_its_connection() -> None:
    closed = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await writer.drain()
        await reader.read()  # returns when the client closes
        closed.set()

    async with raw_server(handler) as (url, accepted):
        pool = _pool()
        response = await pool.request(url, headers=[])
        async for _ in response.iter_raw():
            break
        await response.aclose()  # not read to the end: the engine must see the connection go
        await asyncio.wait_for(closed.wait(), 1)
        assert pool.in_use == 0
        # The next request cannot reuse it and opens a new connection.
        task = asyncio.create_task(pool.request(url, headers=[]))
        await asyncio.sleep(0.1)
        assert accepted == [1, 1]
        task.cancel()
        await pool.aclose()


@pytest.mark.anyio
async def test_stale_keep_alive_connection_is_replaced_transparently() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        # Claims keep-alive, then closes as soon as the response is out.
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()

    async with raw_server(handler) as (url, accepted):
        pool = _pool()
        assert await pool.get(url) == (200, b"ok")
        await asyncio.sleep(0.05)  # the server has closed the idle connection by now
        assert await pool.get(url) == (200, b"ok")
        assert accepted == [1, 1]
        await pool.aclose()
