"""Hostile bodies on raw sockets: strings that are not text (a lone UTF-16 surrogate, `\\ud800`
or its three bytes, which Python's JSON parser takes) in every field the router reads or hashes.
Each is the client's error, 400 `invalid_json` in OpenAI's shape; nothing reaches an engine,
nothing is logged as a failure of the router, and the next client is served.
"""

from __future__ import annotations

import asyncio
import json
import logging
import tempfile
from typing import Any

import pytest

from tests.conftest import Cluster, running_cluster
from tests.wait import wait_until

pytestmark = pytest.mark.e2e  # the router served on loopback in front of fake engines, raw clients

HI = b'[{"role": "user", "content": "hi"}]'
LONG = b'[{"role": "user", "content": "' + b"y" * 700 + b'"}]'  # past a prompt block of the hasher


def _post(path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    fields = {"host": "router", "connection": "close", "content-type": "application/json"}
    fields |= {"content-length": str(len(body)), **(headers or {})}
    head = "".join(f"{name}: {value}\r\n" for name, value in fields.items())
    return f"POST {path} HTTP/1.1\r\n{head}\r\n".encode() + body


def _exchange(port: int, data: bytes) -> tuple[int, bytes]:
    async def run() -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(data)
            async with asyncio.timeout(10):
                return await reader.read()
        finally:
            writer.close()

    head, _, body = asyncio.run(run()).partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


@pytest.mark.parametrize(
    ("path", "body"),
    [
        # The model salts the prompt's block hashes (conversations).
        ("/v1/chat/completions", b'{"model": "test-\\ud800", "messages": ' + LONG + b"}"),
        # The user names the client (fair share, limits, the access log's hash).
        ("/v1/chat/completions", b'{"model": "test-model", "user": "\\udc80x", "messages": ' + HI + b"}"),
        # The prompt's text is hashed by blocks and scanned for code.
        (
            "/v1/chat/completions",
            b'{"model": "test-model", "messages": [{"role": "user", "content": "\\udc80' + b"y" * 700 + b'"}]}',
        ),
        # The stored response it continues names its conversation in the traffic record.
        (
            "/v1/chat/completions",
            b'{"model": "test-model", "previous_response_id": "\\ud83d", "messages": ' + HI + b"}",
        ),
        ("/v1/responses", b'{"model": "test-model", "previous_response_id": "\\udfff", "input": "hi"}'),
        ("/v1/completions", b'{"model": "test-model", "prompt": "a", "\\ud800": 1}'),  # a key
        # Not escaped but encoded: bytes no UTF-8 has, which Python's parser decodes to a surrogate.
        ("/v1/chat/completions", b'{"model": "test-model", "user": "\xed\xb2\x80x", "messages": ' + HI + b"}"),
        ("/v1/completions", b'{"model": "test-model", "prompt": "\xed\xa0\xbd\xed\xb8\x80"}'),  # a pair
    ],
    ids=["model", "user", "prompt", "previous-response", "responses-previous", "key", "raw-user", "raw-pair"],
)
def test_a_lone_surrogate_is_the_clients_error(path: str, body: bytes, caplog: pytest.LogCaptureFixture) -> None:
    with (
        tempfile.TemporaryDirectory() as record,
        running_cluster(
            traffic={"path": f"{record}/traffic.jsonl"}, fairness={"default_limits": {"requests_per_minute": 1000}}
        ) as cluster,
        caplog.at_level(logging.ERROR),
    ):
        port = int(cluster.router.url.rsplit(":", 1)[1])
        status, answer = _exchange(port, _post(path, body))
        error: dict[str, Any] = json.loads(answer)["error"]
        assert (status, error["type"], error["code"]) == (400, "invalid_request_error", "invalid_json"), answer
        assert "surrogate" in error["message"]
        assert cluster.fast.requests == [] and cluster.team.requests == []  # nothing forwarded
        # A surrogate pair is one character, and text: served.
        pair = b'{"model": "test-model", "user": "\\ud83d\\ude00", "messages": ' + LONG + b', "max_tokens": 2}'
        status, answer = _exchange(port, _post("/v1/chat/completions", pair, {"x-session-id": "s"}))
        assert status == 200, answer
        _settled(cluster)
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def _settled(cluster: Cluster) -> None:
    def idle() -> bool:
        return all(
            cluster.metric("specroute_in_flight_requests", pool=p, backend=f"{p}-1") == 0 for p in ("fast", "team")
        )

    wait_until(idle, message="requests in flight back to 0")
