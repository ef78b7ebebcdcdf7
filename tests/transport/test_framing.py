"""One test per HTTP/1.1 framing rule the engine client relies on llhttp for, against raw servers
that send exactly the bytes chosen. Each checks the answer read and whether the connection may
carry the next request: it is reused only after a response wholly and cleanly parsed with
nothing after it; anything else closes it, and the next request gets its own answer on a new one."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable

import pytest

from router.transport import (
    EngineClient,
    HeadLimits,
    ReadTimeout,
    RemoteProtocolError,
    Timeouts,
    TooLarge,
    WrongAnswer,
)
from tests.transport.test_transport import raw_server, read_request

OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
LIMITS = HeadLimits(head_bytes=8192, headers=50)
TIMEOUTS = Timeouts(connect=1.0, read=2.0, idle=2.0)

# What the engine writes for its first request (then `OK` for every later one on any connection).
First = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def exchange(
    first: bytes | First, *, method: str = "POST", headers: list[tuple[str, str]] | None = None
) -> tuple[int, bytes | Exception, int, int]:
    """The first request's (status, body or failure), then a second request's: that it got its
    own `OK`, and on how many connections the two went (1: reused, 2: the first was closed)."""
    answered = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal answered
        while True:
            await read_request(reader)
            answered += 1
            if answered > 1:
                writer.write(OK)
            elif isinstance(first, bytes):
                writer.write(first)
            else:
                await first(reader, writer)
                return
            await writer.drain()

    async with raw_server(handler) as (url, accepted, _):
        client = EngineClient(connections_per_origin=4, tls=ssl.create_default_context())
        status = 0
        result: bytes | Exception = b""
        try:
            response = await client.request(
                url, "/", method=method, headers=headers or [], timeouts=TIMEOUTS, limits=LIMITS
            )
            status = response.status
            try:
                result = await response.read(limit=1 << 20)
            finally:
                await response.aclose()
        except (RemoteProtocolError, ReadTimeout) as exc:
            result = exc
        await asyncio.sleep(0.05)  # bytes sent after the answer reach the idle connection
        second = await client.request(url, "/", headers=[], timeouts=TIMEOUTS, limits=LIMITS)
        assert await second.read(limit=100) == b"ok"
        await second.aclose()
        assert client.in_use == 0
        await client.aclose()
        return status, result, second.status, len(accepted)


@pytest.mark.anyio
@pytest.mark.parametrize(
    "interim", [b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n"]
)
async def test_interim_answers_are_skipped_and_the_connection_kept(interim: bytes) -> None:
    assert await exchange(interim + interim + OK) == (200, b"ok", 200, 1)


@pytest.mark.anyio
async def test_a_101_is_refused_and_its_connection_closed() -> None:
    _, result, _, connections = await exchange(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: x\r\n\r\nraw")
    assert isinstance(result, RemoteProtocolError) and "101" in str(result) and connections == 2


@pytest.mark.anyio
@pytest.mark.parametrize("status", [204, 304])
async def test_a_bodiless_status_ends_at_its_head_and_bytes_after_it_close_the_connection(status: int) -> None:
    # 204 and 304 have no body whatever their fields say: what follows is nobody's answer.
    head = b"HTTP/1.1 %d X\r\ncontent-length: 5\r\n\r\n" % status
    assert await exchange(head + b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nstray") == (status, b"", 200, 2)


@pytest.mark.anyio
async def test_a_bodiless_status_alone_keeps_the_connection() -> None:
    assert await exchange(b"HTTP/1.1 204 No Content\r\n\r\n") == (204, b"", 200, 1)


@pytest.mark.anyio
async def test_two_responses_in_one_write_give_the_first_and_close_the_connection() -> None:
    assert await exchange(OK + b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nextra") == (200, b"ok", 200, 2)


@pytest.mark.anyio
async def test_garbage_after_a_whole_response_closes_the_connection() -> None:
    assert await exchange(OK + b"\x00\x01 not http") == (200, b"ok", 200, 2)


@pytest.mark.anyio
async def test_a_late_response_on_the_idle_connection_closes_it() -> None:
    async def late(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(OK)
        await writer.drain()
        await asyncio.sleep(0.02)  # the client has its answer; the connection is idle in the pool
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nlate")
        await writer.drain()
        await reader.read()

    assert await exchange(late) == (200, b"ok", 200, 2)


@pytest.mark.anyio
@pytest.mark.parametrize(
    "head", [b"HTTP/1.0 200 OK\r\n", b"HTTP/1.1 200 OK\r\nconnection: close\r\n", b"HTTP/1.1 200 OK\r\n"]
)
async def test_a_body_without_length_ends_with_the_connection(head: bytes) -> None:
    async def until_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(head + b"\r\nall ")
        await writer.drain()
        writer.write(b"of it")
        await writer.drain()

    assert await exchange(until_close) == (200, b"all of it", 200, 2)


@pytest.mark.anyio
async def test_http10_keep_alive_with_a_length_is_reused() -> None:
    answer = b"HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ncontent-length: 2\r\n\r\nok"
    assert await exchange(answer) == (200, b"ok", 200, 1)


@pytest.mark.anyio
async def test_chunk_extensions_and_trailers_are_read_past() -> None:
    answer = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2;name=value\r\nok\r\n0\r\nx-trailer: 1\r\n\r\n"
    assert await exchange(answer) == (200, b"ok", 200, 1)


@pytest.mark.anyio
async def test_a_response_written_a_byte_at_a_time_is_read_whole() -> None:
    answer = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"

    async def bytewise(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for i in range(len(answer)):
            writer.write(answer[i : i + 1])
            await writer.drain()
        await read_request(reader)  # the next request, on the same connection
        writer.write(OK)
        await writer.drain()
        await reader.read()

    assert await exchange(bytewise) == (200, b"ok", 200, 1)


@pytest.mark.anyio
@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",  # smuggling
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\nok!",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\nnot chunked",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nok\r\n0\r\n\r\n",  # not a chunk size
        b"HTTP/1.1 200 OK\r\nbad header line\r\ncontent-length: 2\r\n\r\nok",
        b"SMTP ready\r\n\r\n",
    ],
    ids=["length-and-chunked", "two-lengths", "not-chunked", "bad-chunk-size", "bad-field", "not-http"],
)
async def test_ambiguous_or_broken_framing_is_a_protocol_error(answer: bytes) -> None:
    _, result, _, connections = await exchange(answer)
    assert isinstance(result, RemoteProtocolError) and connections == 2


@pytest.mark.anyio
@pytest.mark.parametrize("cut", [b"content-length: 10\r\n\r\nshort", b"transfer-encoding: chunked\r\n\r\n5\r\nab"])
async def test_a_body_cut_short_by_the_connection_is_a_protocol_error(cut: bytes) -> None:
    async def cuts(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\n" + cut)
        await writer.drain()

    _, result, _, connections = await exchange(cuts)
    assert isinstance(result, RemoteProtocolError) and connections == 2


@pytest.mark.anyio
@pytest.mark.parametrize(
    "head",
    [
        b"x-big: " + b"a" * 9000 + b"\r\n",  # one field over the limit
        b"x-h: 1\r\n" * 51,  # one field too many
        b"".join(b"x-h%d: %s\r\n" % (i, b"a" * 1000) for i in range(9)),  # small fields, too many bytes together
    ],
    ids=["huge-field", "too-many-fields", "fields-together"],
)
async def test_an_oversized_head_is_too_large(head: bytes) -> None:
    _, result, _, connections = await exchange(b"HTTP/1.1 200 OK\r\n" + head + b"content-length: 2\r\n\r\nok")
    assert isinstance(result, TooLarge) and connections == 2


@pytest.mark.anyio
async def test_a_head_that_never_ends_is_too_large_before_it_fills_memory() -> None:
    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nx-endless: ")
        for _ in range(10_000):  # 10 MB of one field's value, never ended
            writer.write(b"a" * 1024)
            await writer.drain()

    _, result, _, connections = await exchange(endless)
    assert isinstance(result, TooLarge) and connections == 2


@pytest.mark.anyio
async def test_an_answer_naming_another_request_is_refused_and_its_connection_closed() -> None:
    answer = b"HTTP/1.1 200 OK\r\nx-request-id: other\r\ncontent-length: 2\r\n\r\nok"
    _, result, _, connections = await exchange(answer, headers=[("x-request-id", "mine")])
    assert isinstance(result, WrongAnswer) and connections == 2


@pytest.mark.anyio
async def test_a_head_answer_has_no_body_and_its_connection_is_not_reused() -> None:
    # llhttp cannot be told that the request was a HEAD: the answer ends at its head, and the
    # connection is closed rather than parsed on with a length that has no body behind it.
    assert await exchange(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n", method="HEAD") == (200, b"", 200, 2)
