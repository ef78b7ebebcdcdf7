"""The transport to the engines, against raw servers on loopback that send exactly the bytes we
choose; and, through a whole router, that its timeouts are given per request."""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvloop
import yaml

from router.transport import (
    ConnectError,
    EngineClient,
    HeadLimits,
    ReadTimeout,
    RemoteProtocolError,
    Response,
    Timeouts,
    Transport,
)
from tests.raw_engine import RawEngine

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
LIMITS = HeadLimits(head_bytes=65536, headers=100)


@asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[tuple[str, list[int], asyncio.Condition]]:
    """A server on a free port; yields its URL, the list of connections it accepted, and a
    condition notified at each new one."""
    accepted: list[int] = []
    arrived = asyncio.Condition()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        async with arrived:
            arrived.notify_all()
        try:
            await handler(reader, writer)
        except (asyncio.CancelledError, asyncio.IncompleteReadError, ConnectionError):
            pass  # the test is over, or the client went away: both are fine for a fixture
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", accepted, arrived
    finally:
        server.close()
        await server.wait_closed()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    lengths = [int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")]
    return head + await reader.readexactly(lengths[0] if lengths else 0)


def _transport() -> EngineClient:
    return EngineClient(connections_per_origin=8, tls=ssl.create_default_context())


def _timeouts(read: float = 2.0) -> Timeouts:
    return Timeouts(connect=1.0, read=read, idle=read)


async def _post(transport: Transport, url: str, target: str = "/", **options: Any) -> Any:
    options.setdefault("timeouts", _timeouts())
    return await transport.request(url, target, headers=options.pop("headers", []), limits=LIMITS, **options)


async def _read_into(response: Response, received: list[bytes]) -> None:
    """The body's pieces into `received` as they arrive, until it ends or breaks."""
    async for piece in response.iter_raw():
        received.append(piece)


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

    async with raw_server(handler) as (url, accepted, _):
        transport = _transport()
        for _ in range(2):
            response = await _post(transport, url, "/v1/x?a=1", headers=[("x-test", "1")], body=b'{"k": 1}')
            assert response.status == 200
            assert response.header(b"content-type") == b"text/event-stream"
            pieces = [piece async for piece in response.iter_raw()]
            assert b"".join(pieces) == b"data: 1\n\ndata: 2\n\n"
            assert len(pieces) == 2  # delivered as they came, not gathered
            await response.aclose()
        assert accepted == [1]  # one connection, kept alive
        await transport.aclose()
    assert seen[0].startswith(b"POST /v1/x?a=1 HTTP/1.1\r\n")
    head = seen[0].lower()
    assert b"x-test: 1\r\n" in head and seen[0].endswith(b'\r\n\r\n{"k": 1}')
    # Only what the router chose: no user agent, accept or content type of aiohttp's own.
    assert b"user-agent" not in head and b"accept" not in head and b"content-type" not in head


@pytest.mark.anyio
async def test_the_request_target_goes_on_the_request_line_byte_for_byte() -> None:
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await read_request(reader))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
        await writer.drain()

    target = "/v1/%2e%2e/a%2Fb/./c?x=%3F&y=a+b&z=%25"
    async with raw_server(handler) as (url, _, _):
        transport = _transport()
        await (await _post(transport, url, target)).aclose()
        await transport.aclose()
    assert seen[0].startswith(b"POST " + target.encode() + b" HTTP/1.1\r\n")


@pytest.mark.anyio
async def test_content_length_body_and_get() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 5\r\n\r\nnope!")
        await writer.drain()

    async with raw_server(handler) as (url, _, _):
        transport = _transport()
        assert await transport.get(url + "/health") == (404, b"nope!")
        await transport.aclose()


@pytest.mark.anyio
async def test_connection_closed_mid_body_is_a_protocol_error_after_the_bytes_that_came() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n")
        await writer.drain()

    async with raw_server(handler) as (url, _, _):
        transport = _transport()
        response = await _post(transport, url)
        received: list[bytes] = []
        with pytest.raises(RemoteProtocolError):
            await _read_into(response, received)
        assert received == [b"data: 1\n\n"]
        await response.aclose()
        await transport.aclose()


@pytest.mark.anyio
async def test_silence_is_a_read_timeout_before_the_head_and_an_idle_timeout_between_chunks() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(5)

    async def stalls(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await writer.drain()
        await asyncio.sleep(5)

    transport = _transport()
    async with raw_server(silent) as (url, _, _):
        with pytest.raises(ReadTimeout):
            await _post(transport, url, timeouts=Timeouts(connect=1, read=0.2, idle=10))
    async with raw_server(stalls) as (url, _, _):
        # A long read timeout (the head came at once), a short idle one: the idle one ends it.
        response = await _post(transport, url, timeouts=Timeouts(connect=1, read=10, idle=0.2))
        with pytest.raises(ReadTimeout):
            [piece async for piece in response.iter_raw()]
        await response.aclose()
    await transport.aclose()


@pytest.mark.anyio
async def test_chunks_keep_a_stream_alive_past_its_idle_timeout_until_they_stop() -> None:
    """The idle timeout is silence since the last piece: a stream whose pieces come more often
    than it lives on however long it runs, and ends once they stop."""

    async def trickles(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(24):  # 1.2 s of pieces, more than twice the idle timeout
            writer.write(b"1\r\na\r\n")
            await writer.drain()
            await asyncio.sleep(0.05)
        await asyncio.sleep(5)

    transport = _transport()
    async with raw_server(trickles) as (url, _, _):
        response = await _post(transport, url, timeouts=Timeouts(connect=1, read=10, idle=0.5))
        received: list[bytes] = []
        with pytest.raises(ReadTimeout):
            await _read_into(response, received)
        assert b"".join(received) == b"a" * 24
        await response.aclose()
    await transport.aclose()


@pytest.mark.anyio
async def test_refused_connection_is_a_connect_error() -> None:
    with socket.socket() as placeholder:
        placeholder.bind(("127.0.0.1", 0))
        port = placeholder.getsockname()[1]
        transport = _transport()
        with pytest.raises(ConnectError):
            await _post(transport, f"http://127.0.0.1:{port}")
        await transport.aclose()


@pytest.mark.anyio
async def test_garbage_is_a_protocol_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"SMTP ready\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    async with raw_server(handler) as (url, _, _):
        transport = _transport()
        with pytest.raises(RemoteProtocolError):
            await _post(transport, url)
        await transport.aclose()


@pytest.mark.anyio
async def test_abandoned_response_closes_its_connection() -> None:
    closed = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await writer.drain()
        await reader.read()  # returns when the client closes
        closed.set()

    async with raw_server(handler) as (url, accepted, arrived):
        transport = _transport()
        response = await _post(transport, url)
        async for _ in response.iter_raw():
            break
        await response.aclose()  # not read to the end: the engine must see the connection go
        await asyncio.wait_for(closed.wait(), 5)
        # The next request cannot reuse it and opens a new connection.
        task = asyncio.create_task(_post(transport, url))
        async with arrived:
            await asyncio.wait_for(arrived.wait_for(lambda: len(accepted) == 2), 5)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await transport.aclose()


@pytest.mark.anyio
async def test_the_connection_cap_holds_a_request_until_a_connection_is_free_and_a_reload_moves_it() -> None:
    """At most `connections_per_origin` + 3 (the probes) connections per engine: one more request
    waits for a connection within its connect timeout, gets one as soon as another's answer is
    over, and a reload's new cap applies at once."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            request = await read_request(reader)
            if b"/hold" in request.split(b"\r\n", 1)[0]:
                writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
                await writer.drain()
                await reader.read()  # until the router closes it
                return
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()

    async with raw_server(handler) as (url, accepted, _):
        transport = EngineClient(connections_per_origin=1, tls=ssl.create_default_context())
        held = [await _post(transport, url, "/hold") for _ in range(4)]
        with pytest.raises(ConnectError):
            await _post(transport, url, timeouts=Timeouts(connect=0.2, read=2, idle=2))
        waiting = asyncio.ensure_future(_post(transport, url, timeouts=Timeouts(connect=5, read=2, idle=2)))
        await asyncio.sleep(0.1)
        assert not waiting.done() and len(accepted) == 4
        await held.pop().aclose()  # its connection closed: room for a new one
        answer = await asyncio.wait_for(waiting, 5)
        assert await answer.read(limit=10) == b"ok"
        await answer.aclose()  # pooled
        assert len(accepted) == 5
        held.append(await _post(transport, url, "/hold"))  # on the pooled connection: the cap again
        transport.configure(connections_per_origin=2, tls=transport.tls)
        extra = await _post(transport, url, timeouts=Timeouts(connect=0.2, read=2, idle=2))
        assert await extra.read(limit=10) == b"ok" and len(accepted) == 6
        await extra.aclose()
        for response in held:
            await response.aclose()
        assert transport.in_use == 0
        await transport.aclose()


@pytest.mark.anyio
async def test_a_get_on_a_stale_keep_alive_connection_is_replaced() -> None:
    """GETs are idempotent: aiohttp sends one again on a new connection when a pooled one turns
    out closed (RFC 9112 §9.3.1). POSTs never are: see tests/test_hostile_engine.py."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        # Claims keep-alive, then closes as soon as the response is out.
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()

    async with raw_server(handler) as (url, accepted, _):
        transport = _transport()
        assert await transport.get(url) == (200, b"ok")
        assert await transport.get(url) == (200, b"ok")
        assert accepted == [1, 1]
        await transport.aclose()


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_pooled_connection_the_engine_closed_is_never_written_on(loop: str) -> None:
    """The engine closes a pooled connection and its FIN waits, unread, in the kernel when the pool
    would hand the connection out. The connection is looked at first and dropped: the request goes
    on a new connection and arrives once (written on the closed one, nobody could tell whether the
    engine read it)."""

    async def scenario(engine: RawEngine) -> None:
        transport = _transport()
        try:
            first = await _post(transport, engine.url, body=b"first")
            await first.read(limit=1000)
            await first.aclose()  # pooled
            # Blocks this loop until the engine has closed it: its FIN waits, unread, in the
            # kernel when the pool hands the connection out just below (no await in between).
            assert engine.close_idle() == 1
            second = await _post(transport, engine.url, body=b"second")
            assert second.status == 200
            await second.aclose()
        finally:
            await transport.aclose()

    with RawEngine() as engine:
        (uvloop.run if loop == "uvloop" else asyncio.run)(scenario(engine))
    assert [(exchange.connection, exchange.body) for exchange in engine.requests] == [(1, b"first"), (2, b"second")]


@pytest.mark.e2e  # through a whole router, served on loopback
def test_a_reload_reaches_pooled_connections(
    tmp_path: Path, make_cluster: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Timeouts go with each request: after a reload from a 5 s to a 0.3 s read timeout, a request
    on a connection pooled before the reload and one on a new connection both time out."""
    config = tmp_path / "router.yaml"
    monkeypatch.setenv("SPECROUTE_TEST_ADMIN_KEY", "admin-secret")
    settings = {
        "timeouts": {"read": 5.0},
        "retries": {"attempts": 1},
        "auth": {"admin_key_env": "SPECROUTE_TEST_ADMIN_KEY"},
    }
    with make_cluster(config_file=config, **settings) as cluster:
        chat = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        url = cluster.base_url + "/chat/completions"
        headers = {"X-Route-Pool": "fast"}
        cluster.fast.first_token_delay = 1.0
        assert httpx.post(url, json=chat, headers=headers, timeout=10).status_code == 200  # pools a connection
        data = yaml.safe_load(config.read_text())
        data["timeouts"] = {"read": 0.3}
        config.write_text(yaml.safe_dump(data))
        admin = httpx.post(
            cluster.router.url + "/admin/reload", headers={"authorization": "Bearer admin-secret"}, timeout=10
        )
        assert admin.status_code == 200, admin.text
        both = [httpx.post(url, json=chat, headers=headers, timeout=10) for _ in range(2)]
        # The second is sent while the first's engine request is still running: a new connection.
        assert [r.status_code for r in both] == [504, 504]
        assert {r.json()["error"]["code"] for r in both} == {"upstream_timeout"}
