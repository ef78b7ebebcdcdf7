"""The misbehaving wire server the soak's chaos engine runs on, seen from a raw socket."""

from __future__ import annotations

import asyncio
import json

from tests.fake_engine import FakeEngine
from tests.wire import WireChaos, WireServer

REQUEST = b'{"model": "test-model", "messages": [], "max_tokens": 3}'


def _request(request_id: str) -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: engine\r\nContent-Type: application/json\r\n"
        b"X-Request-Id: " + request_id.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(REQUEST) + REQUEST
    )


async def _read_answer(reader: asyncio.StreamReader) -> tuple[list[bytes], dict[str, object]]:
    """Status lines up to the final answer, and its JSON body (sent with a Content-Length)."""
    statuses = []
    while True:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        statuses.append(head.split(b"\r\n", 1)[0])
        if not head.startswith(b"HTTP/1.1 1"):
            break
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    body: dict[str, object] = json.loads(await reader.readexactly(length))
    return statuses, body


def test_interim_answers_come_before_the_real_one() -> None:
    async def scenario() -> tuple[list[bytes], dict[str, object]]:
        async with await WireServer(FakeEngine().app(), WireChaos(interim=1.0)).start() as server:
            port = server.sockets[0].getsockname()[1]
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(_request("r1"))
            answer = await _read_answer(reader)
            writer.close()
            await writer.wait_closed()
            return answer

    statuses, body = asyncio.run(scenario())
    assert statuses == [b"HTTP/1.1 100 Continue", b"HTTP/1.1 103 Early Hints", b"HTTP/1.1 200 OK"]
    assert body["id"] == "cmpl-r1"  # the request's own id


def test_a_late_copy_arrives_unasked_on_the_idle_connection() -> None:
    async def scenario() -> tuple[dict[str, object], dict[str, object], dict[str, object]]:
        async with await WireServer(FakeEngine().app(), WireChaos(late=1.0, late_after=0.01)).start() as server:
            port = server.sockets[0].getsockname()[1]
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(_request("r1"))
            _, first = await _read_answer(reader)
            _, copy = await _read_answer(reader)  # nothing asked: the same answer again
            writer.write(_request("r2"))
            _, second = await _read_answer(reader)  # the connection still serves
            writer.close()
            await writer.wait_closed()
            return first, copy, second

    first, copy, second = asyncio.run(scenario())
    assert first["id"] == copy["id"] == "cmpl-r1"
    assert second["id"] == "cmpl-r2"
