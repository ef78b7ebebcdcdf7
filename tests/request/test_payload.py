"""Reading a client's JSON within the depth limit: the boundary, and never a RecursionError."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from starlette.types import Message, Receive

from router.errors import BadRequest, PayloadTooLarge, RequestTimeout
from router.request.payload import ClientGone, body_chunks, parse_json, read_body


def _nested(depth: int) -> bytes:
    return b'{"a":' * (depth - 1) + b"[1]" + b"}" * (depth - 1)


@pytest.mark.parametrize(
    ("body", "value"),
    [
        (b"{}", {}),
        (b'{"text": "[[[[[[{{{{{{"}', {"text": "[[[[[[{{{{{{"}),  # brackets in a string count for nothing
        (b"[" * 4 + b"]" * 4, [[[[]]]]),  # exactly the limit
        (_nested(4), {"a": {"a": {"a": [1]}}}),
        (b"7", 7),
    ],
)
def test_json_within_the_depth_limit_is_read(body: bytes, value: Any) -> None:
    assert parse_json(body, max_depth=4) == value


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 5 + b"]" * 5,  # one past the limit
        _nested(5),
        b"[" * 100_000 + b"]" * 100_000,  # the parser would recurse past Python's limit
        b"[" * 100_000,  # and unclosed
        b'{"a": ',
        b"\xff\xfe{",
    ],
)
def test_json_past_the_depth_limit_or_broken_is_400_invalid_json(body: bytes) -> None:
    with pytest.raises(BadRequest) as raised:
        parse_json(body, max_depth=4)
    assert raised.value.code == "invalid_json"


# -- the body reader ---------------------------------------------------------------------------


def _receive(*messages: Message, then_wait: bool = False) -> tuple[Receive, list[Message]]:
    """An ASGI receive giving `messages` in turn, then (`then_wait`) nothing ever again; and the
    list of those it gave."""
    given: list[Message] = []
    queue = list(messages)

    async def receive() -> Message:
        if not queue:
            assert then_wait, "read past the end of the body"
            await anyio.sleep_forever()
        given.append(queue.pop(0))
        return given[-1]

    return receive, given


def _chunk(body: bytes, more: bool = True) -> Message:
    return {"type": "http.request", "body": body, "more_body": more}


@pytest.mark.anyio
async def test_a_body_is_read_whole_within_its_limits() -> None:
    receive, _ = _receive(_chunk(b"ab"), _chunk(b""), _chunk(b"cd", more=False))
    assert await read_body(receive, limit=4, within=5, declared="4") == b"abcd"


@pytest.mark.anyio
async def test_a_body_declared_too_large_is_413_before_any_of_it_is_read() -> None:
    receive, given = _receive(_chunk(b"x", more=False))
    with pytest.raises(PayloadTooLarge) as caught:
        await read_body(receive, limit=4, within=5, declared="5", code="file_too_large")
    assert caught.value.code == "file_too_large" and not given


@pytest.mark.anyio
async def test_a_body_found_too_large_is_413_at_the_chunk_that_passes_the_limit() -> None:
    receive, given = _receive(_chunk(b"abc"), _chunk(b"de"), _chunk(b"never read", more=False))
    chunks: list[bytes] = []

    async def read() -> None:
        async for chunk in body_chunks(receive, limit=4, within=5):
            chunks.append(chunk)

    with pytest.raises(PayloadTooLarge) as caught:
        await read()
    assert caught.value.code == "body_too_large" and chunks == [b"abc"] and len(given) == 2


@pytest.mark.anyio
async def test_a_body_not_received_in_time_is_408() -> None:
    receive, _ = _receive(_chunk(b"ab"), then_wait=True)
    started = anyio.current_time()
    with pytest.raises(RequestTimeout) as caught:
        await read_body(receive, limit=100, within=0.2)
    assert caught.value.code == "body_timeout" and anyio.current_time() - started >= 0.2


@pytest.mark.anyio
async def test_a_client_that_leaves_is_client_gone() -> None:
    receive, _ = _receive(_chunk(b"ab"), {"type": "http.disconnect"})
    with pytest.raises(ClientGone):
        await read_body(receive, limit=100, within=5)
