"""Served by the router's own listener, a stream's pieces go from the engine's connection straight
to the client's (router.request.relay, `ClientStream`): the client gets every event, in order,
and the app sends no ASGI message per piece, only the head and the last part."""

from __future__ import annotations

import asyncio
import json
import socket
from collections import Counter
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.types import Message, Receive, Scope, Send

from router.app import create_app
from router.config import Settings
from tests.backends.test_scrape import _socket_buffers
from tests.fake_engine import FakeEngine
from tests.raw_engine import Exchange, RawEngine, answer_normally
from tests.servers import ServerThread
from tests.transport.test_hostile_engine import MiB, assert_recovered, routed
from tests.wait import wait_until

pytestmark = pytest.mark.e2e  # the router served on loopback in front of a fake engine


class _CountSends:
    """The router's app, unchanged, inside: counts the ASGI messages it sends, by type."""

    def __init__(self, app: Starlette, counts: Counter[str]) -> None:
        self.app = app
        self.state = app.state  # what ServerThread and the listener read of a router's app
        self.counts = counts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def counted(message: Message) -> None:
            if scope["type"] == "http" and scope["path"].endswith("/chat/completions"):
                self.counts[message["type"]] += 1
            await send(message)

        await self.app(scope, receive, counted)


def test_a_streams_pieces_reach_the_client_without_an_asgi_message_each() -> None:
    engine = FakeEngine(model="test-model", token_delay=0.002)
    counts: Counter[str] = Counter()
    with ServerThread(engine.app()) as upstream:
        settings: dict[str, Any] = {
            "pools": {"p": {"speculative": False, "backends": {"e": {"url": upstream.url, "max_concurrency": 4}}}},
            "scrape": {"interval": 60},
            "health": {"interval": 60},
        }
        app = _CountSends(create_app(Settings(**settings), registry=CollectorRegistry()), counts)
        with ServerThread(app, fast=True) as router, httpx.Client(base_url=router.url + "/v1", timeout=30) as client:
            chat = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
            reply = client.post("/chat/completions", json={**chat, "max_tokens": 40})
    assert reply.status_code == 200
    events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    words = [json.loads(e)["choices"][0]["delta"].get("content") for e in events[:-1]]
    assert "".join(w for w in words if w) == "".join(f"w{i} " for i in range(40))
    # The head and the last part (the stream's end) only: the 40 tokens' pieces went around ASGI.
    assert counts == {"http.response.start": 1, "http.response.body": 1}


def test_a_stream_is_read_no_further_than_its_client_takes_from_the_first_write() -> None:
    # The client reads nothing. The pieces already here when the relay starts are more than the
    # socket takes, so that first write pauses the client's connection: the engine's is paused
    # with it, and stays so (the relay starting did not resume it). The engine writes 256 MiB as
    # fast as it may; it gets no further than the socket buffers until the client is cut off.
    event = b'data: {"choices": [{"index": 0, "delta": {"content": "' + b"x" * 65_000 + b'"}}]}\n\n'
    total = 256 * MiB
    written = {"bytes": 0, "ended": False}

    async def answer(exchange: Exchange, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        if exchange.index > 0:
            return await answer_normally(exchange, reader, writer)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        chunk = b"%x\r\n%s\r\n" % (len(event), event)
        try:
            while written["bytes"] < total:
                writer.write(chunk)
                written["bytes"] += len(chunk)
                await writer.drain()
        finally:
            written["ended"] = True
        return False

    with RawEngine(answer) as engine, routed(engine.url, timeouts={"client_write": 2}) as router:
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        try:
            client.connect(("127.0.0.1", router.server.port))
            body = json.dumps({"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "stream": True})
            head = "POST /v1/chat/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
            client.sendall(f"{head}content-length: {len(body)}\r\n\r\n{body}".encode())
            wait_until(lambda: written["ended"], timeout=60, message="the engine's answer ended (client cut off)")
        finally:
            client.close()
        assert written["bytes"] <= _socket_buffers() + 2 * MiB, written
        assert_recovered(router)
