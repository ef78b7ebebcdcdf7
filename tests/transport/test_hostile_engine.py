"""Engines that misbehave on the wire, one test per behaviour (docs/reliability.md lists them).

Each answer carries the id of the request it answers, so a test can see that every client got
its own answer. After each: no request is left in flight and a normal request is served.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import pytest
import uvloop
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from router.app import create_app
from router.config import Settings
from router.transport import KEEP_ALIVE_SECONDS
from tests.conftest import _merge
from tests.raw_engine import Exchange, RawEngine, answer_normally, completion, response
from tests.servers import ServerThread
from tests.wait import until, wait_until

T = TypeVar("T")

MiB = 1024 * 1024


@dataclass
class Routed:
    server: ServerThread
    client: httpx.Client
    registry: CollectorRegistry
    app: Starlette

    def ask(self, request_id: str, **extra: Any) -> httpx.Response:
        body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], **extra}
        return self.client.post("/chat/completions", json=body, headers={"x-request-id": request_id})

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    def total(self, name: str, **labels: str) -> float:
        """The sum of the metric's samples that have these labels, whatever their others."""
        return sum(
            sample.value
            for family in self.registry.collect()
            for sample in family.samples
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
        )

    def settled(self, name: str, expected: float, **labels: str) -> float:
        """The metric's total once it reads `expected`, or after 2 s (it is set in another thread)."""
        deadline = time.monotonic() + 2
        while (value := self.total(name, **labels)) != expected and time.monotonic() < deadline:
            time.sleep(0.005)
        return value


@contextmanager
def routed(engine_url: str, **overrides: Any) -> Iterator[Routed]:
    """A router with one pool, `p`, whose one backend, `e`, is the engine; probes run rarely, so a
    test decides what happens on each connection."""
    data = _merge(
        {
            "pools": {"p": {"speculative": False, "backends": {"e": {"url": engine_url, "max_concurrency": 8}}}},
            "scrape": {"interval": 60},
            "health": {"interval": 60},
        },
        overrides,
    )
    registry = CollectorRegistry()
    app = create_app(Settings(**data), registry=registry)
    with (
        ServerThread(app, fast=True) as server,
        httpx.Client(base_url=server.url + "/v1", timeout=30) as client,
    ):
        yield Routed(server, client, registry, app)


def answer_for(request_id: str) -> bytes:
    """The body an engine would send for the request with this id."""
    return completion(Exchange(0, 0, 0, "POST", "", {"x-request-id": request_id}, b""))


def answer_text(response: httpx.Response) -> str:
    text: str = response.json()["choices"][0]["message"]["content"]
    return text


def assert_own_answers(router: Routed, count: int = 10) -> None:
    """`count` requests one after the other (so each takes the pooled connection): each gets its own answer."""
    for i in range(count):
        reply = router.ask(f"client-{i}")
        assert reply.status_code == 200, reply.text
        assert answer_text(reply) == f"client-{i}"


def assert_recovered(router: Routed) -> None:
    assert router.settled("specroute_in_flight_requests", 0, pool="p", backend="e") == 0
    assert router.metric("specroute_queued_requests", pool="p", job_class="interactive") == 0
    # No engine response left open (a health probe or a scrape out this moment is back within ms).
    wait_until(lambda: router.app.state.router.transport.in_use == 0, message="no engine response left open")
    reply = router.ask("after")
    assert reply.status_code == 200 and answer_text(reply) == "after"


def assert_upstream_failed(reply: httpx.Response) -> None:
    assert reply.status_code == 502
    assert reply.headers["content-type"] == "application/json"
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "upstream_failed" and error["type"] == "upstream_error"


def events(reply: httpx.Response) -> list[str]:
    return [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]


# -- interim answers -------------------------------------------------------------------------


@pytest.mark.e2e
def test_client_expect_100_continue_is_answered_by_the_router_and_never_forwarded() -> None:
    """curl sends `Expect: 100-continue` with any body over 1 MB. uvicorn (under vLLM and SGLang)
    answers it with `100 Continue`: were it forwarded, that interim answer could be taken as the
    final one and the real answer handed to the next client."""
    seen: list[dict[str, str]] = []

    async def chat(request: Request) -> Response:
        await request.body()  # uvicorn sends `100 Continue` here if the request asked for it
        seen.append(dict(request.headers))
        rid = request.headers["x-request-id"]
        return Response(answer_for(rid), media_type="application/json")

    async def ok(request: Request) -> Response:
        return Response(b'{"object": "list", "data": []}')

    engine = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/{p:path}", ok)])
    with ServerThread(engine) as server, routed(server.url) as router:
        body = json.dumps({"model": "test-model", "messages": [{"role": "user", "content": "x" * 2 * MiB}]}).encode()
        with socket.create_connection(("127.0.0.1", router.server.port), timeout=30) as client:
            client.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n"
                b"x-request-id: curl-1\r\nexpect: 100-continue\r\ncontent-length: %d\r\n\r\n" % len(body)
            )
            assert client.recv(64).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")  # from the router's own server
            client.sendall(body)
            received = b""
            while b"curl-1" not in received or not received.endswith(b"}"):
                chunk = client.recv(65536)
                assert chunk, received
                received += chunk
        assert received.startswith(b"HTTP/1.1 200 ")
        assert "expect" not in seen[0]
        assert_own_answers(router)
        assert_recovered(router)


@pytest.mark.e2e
@pytest.mark.parametrize("interim", [100, 102, 103])
def test_interim_answers_from_the_engine_are_never_final(interim: int) -> None:
    async def answer(exchange: Exchange, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        hint = b"link: </style.css>; rel=preload\r\n" if interim == 103 else b""
        writer.write(b"HTTP/1.1 %d Interim\r\n%s\r\n" % (interim, hint) + response(body=completion(exchange)))
        return True

    with RawEngine(answer) as engine, routed(engine.url) as router:
        assert_own_answers(router)
        assert engine.closed == set()  # the interim answers cost no connection
        assert_recovered(router)


@pytest.mark.e2e
def test_101_from_the_engine_is_a_502() -> None:
    async def answer(exchange: Exchange, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        if exchange.index > 0:
            return await answer_normally(exchange, reader, writer)
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\nraw bytes")
        return False

    with RawEngine(answer) as engine, routed(engine.url) as router:
        assert_upstream_failed(router.ask("upgraded"))
        assert_recovered(router)


# -- bytes that are nobody's answer ------------------------------------------------------------


@pytest.mark.e2e
def test_a_late_extra_response_on_an_idle_pooled_connection_is_never_anyones_answer() -> None:
    late_sent = False
    answered = threading.Event()  # the client has the first answer
    routers: list[Routed] = []

    def pooled() -> bool:
        # The first answer has reached the client and its request is finished at the router,
        # which closes the engine's response first: the connection is idle in the router's pool.
        return answered.is_set() and routers[0].total("specroute_in_flight_requests", pool="p", backend="e") == 0

    async def answer(exchange: Exchange, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        nonlocal late_sent
        writer.write(response(body=completion(exchange)))
        if exchange.index == 0:
            await writer.drain()
            await until(pooled, message="the first answer's connection back in the router's pool")
            writer.write(response(body=answer_for("LATE")))
            late_sent = True
        return True

    with RawEngine(answer) as engine, routed(engine.url) as router:
        routers.append(router)
        assert answer_text(router.ask("first")) == "first"
        answered.set()
        assert engine.wait_for(lambda: late_sent)
        assert_own_answers(router)
        assert_recovered(router)


def echoing(exchange: Exchange, request_id: str | None = None) -> bytes:
    """The answer to `exchange` (or to the request `request_id`), echoing its id as vLLM does
    with `--enable-request-id-headers`."""
    request_id = request_id or exchange.request_id
    body = answer_for(request_id) if request_id != exchange.request_id else completion(exchange)
    return response(body=body, headers=b"x-request-id: %s\r\n" % request_id.encode())


@pytest.mark.e2e
def test_an_answer_naming_another_request_is_never_passed_on() -> None:
    """The race a late copy can win: it lands just after the next request went out on the pooled
    connection, so it reads as that request's answer; only the echoed id tells them apart."""

    copied_on: list[int] = []  # the connection that carried the copy (the probes may have opened others first)

    async def answer(exchange: Exchange, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        if exchange.index == 1:
            writer.write(echoing(exchange, "first"))  # the copy, written as the request arrives
            copied_on.append(exchange.connection)
        writer.write(echoing(exchange))
        return True

    with RawEngine(answer) as engine, routed(engine.url) as router:
        assert answer_text(router.ask("first")) == "first"
        reply = router.ask("second")  # no other backend to try
        assert_upstream_failed(reply)
        assert "first" not in reply.text
        assert router.total("specroute_upstream_errors_total", kind="wrong_answer") == 1
        # Closed by the router at once, not left in its pool until the keep-alive time ends it.
        assert engine.wait_for(lambda: set(copied_on) <= engine.closed, timeout=KEEP_ALIVE_SECONDS / 2)
        assert_own_answers(router)
        assert_recovered(router)


@pytest.mark.e2e
def test_a_copy_of_a_probes_answer_is_never_a_clients_answer() -> None:
    """The router's own GETs (health, metrics, models) share the pooled connections: a copy of a
    probe's answer, sent again unasked, can land just after a client's request went out on the
    same connection. The probes carry an id of their own for that (in the soak, id-less copies
    of their answers reached clients: an unshaped 404, a 200 that was not JSON)."""
    engines: list[RawEngine] = []

    async def answer(exchange: Exchange, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        copy = engines[0].probe_answers.pop(exchange.connection, None)
        if copy is not None and exchange.index == 0:  # the last request here was a probe: its answer again
            writer.write(copy)
        writer.write(echoing(exchange))
        return True

    with RawEngine(answer) as engine, routed(engine.url) as router:
        engines.append(engine)
        backend = router.app.state.router.pools["p"].backends[0]
        # The first scrape is done: its connection is back in the pool, where the next request takes it.
        assert engine.wait_for(lambda: backend.engine.reading.scraped_at > 0)
        reply = router.ask("first")  # no other backend to try
        assert engine.requests[0].earlier > 0, "the request did not take a probe's connection"
        assert_upstream_failed(reply)
        assert router.total("specroute_upstream_errors_total", kind="wrong_answer") == 1
        assert all(b"x-request-id: " in head for head in engine.heads)  # every request carried one
        assert_own_answers(router)
        assert_recovered(router)


@pytest.mark.e2e
def test_an_answer_naming_another_request_is_retried_elsewhere() -> None:
    async def answer(exchange: Exchange, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(echoing(exchange, "someone-else") + echoing(exchange))
        return True

    with RawEngine(answer) as bad, RawEngine() as good:
        other = {"pools": {"p": {"backends": {"good": {"url": good.url, "max_concurrency": 8}}}}}
        with routed(bad.url, **other) as router:
            for i in range(4):  # whichever backend each is sent to first
                reply = router.ask(f"client-{i}")
                assert reply.status_code == 200 and answer_text(reply) == f"client-{i}"
                assert reply.headers["x-route-backend"] == "good"
            assert bad.requests, "the engine that answers wrongly was never asked"
            wrong = router.total("specroute_upstream_errors_total", backend="e", kind="wrong_answer")
            assert wrong == len(bad.requests) == router.total("specroute_retries_total", backend="e")


@pytest.mark.e2e
def test_two_responses_in_one_write() -> None:
    async def answer(exchange: Exchange, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        extra = response(body=answer_for("EXTRA")) if exchange.index == 0 else b""
        writer.write(response(body=completion(exchange)) + extra)
        return True

    with RawEngine(answer) as engine, routed(engine.url) as router:
        assert answer_text(router.ask("first")) == "first"
        assert_own_answers(router)
        assert_recovered(router)


@pytest.mark.e2e
def test_a_204_followed_by_bytes() -> None:
    async def answer(exchange: Exchange, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        if exchange.index > 0:
            return await answer_normally(exchange, reader, writer)
        writer.write(b"HTTP/1.1 204 No Content\r\n\r\n" + response(body=answer_for("AFTER-204")))
        return True

    with RawEngine(answer) as engine, routed(engine.url) as router:
        reply = router.ask("first")
        assert reply.status_code == 204 and reply.content == b""
        assert_own_answers(router)
        assert_recovered(router)


@pytest.mark.e2e
def test_a_reused_connection_closed_after_the_engine_read_the_post_is_not_sent_again() -> None:
    async def answer(exchange: Exchange, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        if exchange.index == 1:
            return False  # read it, then close without a word
        return await answer_normally(exchange, reader, writer)

    with RawEngine(answer) as engine, routed(engine.url) as router:
        assert answer_text(router.ask("first")) == "first"
        assert_upstream_failed(router.ask("second"))
        assert engine.requests[1].earlier > 0  # the second went on a pooled connection...
        assert [e.request_id for e in engine.requests].count("second") == 1  # ...and was not sent again
        assert router.metric("specroute_retries_total", pool="p", backend="e", reason="protocol") == 0
        assert_recovered(router)


@asynccontextmanager
async def _router_on_this_loop(
    engine: RawEngine, registry: CollectorRegistry
) -> AsyncIterator[Callable[[str], Awaitable[httpx.Response]]]:
    """A router in front of `engine` alone, served on the running loop through httpx's ASGI
    transport and probing nothing meanwhile, so that a test can time what happens on the loop
    between two requests. Yields `ask(request_id)`: a chat request pinned to the engine's pool."""
    settings: dict[str, Any] = {
        "pools": {"p": {"speculative": False, "backends": {"e": {"url": engine.url, "max_concurrency": 8}}}},
        "scrape": {"interval": 60},
        "health": {"interval": 60},
        # No hold for a new client: the request reaches the pool without a pause.
        "classify": {"burst_hold_seconds": 0},
    }
    app = create_app(Settings(**settings), registry=registry)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r/v1")
    async with app.router.lifespan_context(app), client:

        async def ask(request_id: str) -> httpx.Response:
            body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}]}
            headers = {"x-request-id": request_id, "x-route-pool": "p"}  # pinned: no other place to go
            return await client.post("/chat/completions", json=body, headers=headers)

        yield ask


def _run(loop: str, scenario: Awaitable[T]) -> T:
    return (uvloop.run if loop == "uvloop" else asyncio.run)(scenario)  # type: ignore[arg-type]


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_pooled_connection_the_engine_closed_is_not_used_for_a_pinned_post(loop: str) -> None:
    """uvicorn closes a keep-alive connection idle for 5 s. When its FIN is still unread in the
    kernel as the router takes the connection from its pool, the connection is dropped and the
    request goes on a new one to the same backend, pinned as it is: the engine sees it once, and
    nothing had to be sent again. Seen on real vLLM engines as an intermittent 502 of a pinned
    request (tests/real). The router runs in this thread, so the engine's FIN can be timed
    before the request."""
    registry = CollectorRegistry()

    async def scenario(engine: RawEngine) -> list[httpx.Response]:
        async with _router_on_this_loop(engine, registry) as ask:
            replies = [await ask("first")]  # its connection goes back to the pool
            # Blocks this loop until the engine has closed its idle connections: the FINs wait
            # unread in the kernel while the router takes one from its pool for the next request.
            assert engine.close_idle() >= 1
            replies.append(await ask("second"))
            return replies

    with RawEngine() as engine:
        first, second = _run(loop, scenario(engine))
    assert first.status_code == 200 and answer_text(first) == "first"
    assert second.status_code == 200, second.text
    assert answer_text(second) == "second"
    assert [exchange.request_id for exchange in engine.requests] == ["first", "second"]  # once each
    labels = {"pool": "p", "backend": "e"}
    assert registry.get_sample_value("specroute_retries_total", {**labels, "reason": "not_sent"}) is None
    assert registry.get_sample_value("specroute_upstream_errors_total", {**labels, "kind": "protocol"}) is None


@pytest.mark.e2e  # holds its loop up for over 4 s
@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_connection_idle_past_keep_alive_by_the_kernels_clock_is_not_reused(loop: str) -> None:
    """aiohttp counts a pooled connection's idle time from when the loop put it back in the pool,
    the engine from when it sent its answer. Here the router's loop is held up while the answer
    arrives, as on a starved machine, so the loop's count starts `KEEP_ALIVE_SECONDS` late: by
    the kernel's count the connection has been idle that long, the engine may be closing it
    (uvicorn does at 5 s), and the next request goes on a new connection."""
    release = threading.Event()

    async def after_release(exchange: Exchange, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        if exchange.index == 0:  # answered once the router's loop is held up
            assert await asyncio.to_thread(release.wait, 30)
        return await answer_normally(exchange, reader, writer)

    async def scenario(engine: RawEngine) -> list[httpx.Response]:
        async with _router_on_this_loop(engine, CollectorRegistry()) as ask:
            first = asyncio.ensure_future(ask("first"))
            await until(lambda: engine.requests, message="the first request at the engine")
            release.set()
            time.sleep(KEEP_ALIVE_SECONDS + 0.5)  # noqa: ASYNC251 -- this loop held up: the answer waits in the kernel
            return [await first, await ask("second")]

    with RawEngine(after_release) as engine:
        first, second = _run(loop, scenario(engine))
    assert answer_text(first) == "first" and answer_text(second) == "second"
    assert [exchange.request_id for exchange in engine.requests] == ["first", "second"]  # once each
    assert engine.requests[1].connection != engine.requests[0].connection


# -- bodies the router must read right ---------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("version", "headers"), [(b"HTTP/1.0", b""), (b"HTTP/1.1", b"connection: close\r\n")], ids=["http10", "close"]
)
def test_close_delimited_bodies_are_served(version: bytes, headers: bytes) -> None:
    async def answer(exchange: Exchange, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        body = completion(exchange)
        writer.write(b"%s 200 OK\r\ncontent-type: application/json\r\n%s\r\n" % (version, headers))
        for start in range(0, len(body), 40):  # in several writes: the end is the connection's end
            writer.write(body[start : start + 40])
            await writer.drain()
        return False

    with RawEngine(answer) as engine, routed(engine.url) as router:
        assert_own_answers(router, count=3)
        assert len({e.connection for e in engine.requests}) == 3
        assert_recovered(router)


@pytest.mark.e2e
def test_a_close_delimited_stream_is_served() -> None:
    async def answer(exchange: Exchange, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        if exchange.index > 0:
            return await answer_normally(exchange, reader, writer)
        writer.write(b"HTTP/1.0 200 OK\r\ncontent-type: text/event-stream\r\n\r\n")
        for word in ("a", "b"):
            writer.write(b'data: {"choices": [{"index": 0, "delta": {"content": "%s"}}]}\n\n' % word.encode())
            await writer.drain()
        writer.write(b"data: [DONE]\n\n")
        return False

    with RawEngine(answer) as engine, routed(engine.url) as router:
        reply = router.ask("stream", stream=True)
        assert reply.status_code == 200
        assert [json.loads(e)["choices"][0]["delta"]["content"] for e in events(reply)[:2]] == ["a", "b"]
        assert events(reply)[-1] == "[DONE]"
        assert_recovered(router)


@pytest.mark.e2e
def test_gzip_answers_reach_the_client_decoded() -> None:
    """The router asks for identity; an engine that compresses anyway has its body decoded, and
    the client gets it with no Content-Encoding, whole or streamed."""
    stream_events = [
        b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n',
        b'data: {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 7, "total_tokens": 8}}\n\n',
        b"data: [DONE]\n\n",
    ]

    async def answer(exchange: Exchange, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        assert exchange.headers["accept-encoding"] == "identity"
        if b'"stream":true' not in exchange.body:
            body = gzip.compress(completion(exchange))
            writer.write(response(body=body, headers=b"content-encoding: gzip\r\n"))
            return True
        packed = gzip.compress(b"".join(stream_events))
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-encoding: gzip\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        for start in range(0, len(packed), 16):
            piece = packed[start : start + 16]
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        return True

    with RawEngine(answer) as engine, routed(engine.url) as router:
        whole = router.ask("whole")
        assert whole.status_code == 200 and answer_text(whole) == "whole"
        assert "content-encoding" not in whole.headers
        assert int(whole.headers["content-length"]) == len(whole.content)
        streamed = router.ask("streamed", stream=True)
        assert streamed.status_code == 200 and "content-encoding" not in streamed.headers
        assert streamed.content == b"".join(stream_events[::2])  # the usage chunk was the router's to drop
        assert router.settled("specroute_completion_tokens_total", 1 + 7, pool="p", backend="e") == 8
        assert_recovered(router)


# -- sizes past the limits ----------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize(
    "head",
    [
        b"x-big: " + b"a" * (100 * 1024) + b"\r\n",  # one field over the head limit
        b"x-h: 1\r\n" * 100_000,  # far more fields than allowed
        b"".join(b"x-h%d: %s\r\n" % (i, b"a" * 1000) for i in range(90)),  # few fields, over the limit together
    ],
    ids=["huge-field", "100000-fields", "many-large-fields"],
)
def test_huge_response_heads_are_a_502_with_nothing_passed_on(head: bytes) -> None:
    async def answer(exchange: Exchange, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        if exchange.index > 0:
            return await answer_normally(exchange, reader, writer)
        writer.write(b"HTTP/1.1 200 OK\r\n" + head + b"content-length: 2\r\n\r\n{}")
        return False

    with RawEngine(answer) as engine, routed(engine.url) as router:
        reply = router.ask("huge-head")
        assert_upstream_failed(reply)
        assert not any(name.startswith(("x-big", "x-h")) for name in reply.headers)
        assert_recovered(router)


@pytest.mark.e2e
@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_huge_body_is_refused_not_buffered(declared: bool) -> None:
    """The limit is 1 MiB; the engine offers 256 MiB. The router stops reading at the limit, so
    the engine cannot write more than the sockets' buffers hold beyond it."""
    block = b"a" * 65536
    total = 256 * MiB

    async def answer(exchange: Exchange, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        if exchange.index > 0:
            return await answer_normally(exchange, reader, writer)
        framing = b"content-length: %d\r\n" % total if declared else b"transfer-encoding: chunked\r\n"
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n" + framing + b"\r\n")
        while engine.written < total:
            writer.write(block if declared else b"10000\r\n" + block + b"\r\n")
            await writer.drain()
            engine.written += len(block)
        return False

    with RawEngine(answer) as engine, routed(engine.url, limits={"response_body_bytes": MiB}) as router:
        assert_upstream_failed(router.ask("huge-body"))
        assert engine.wait_for(lambda: engine.requests[0].connection in engine.closed)
        assert engine.written < 64 * MiB, engine.written
        assert_recovered(router)


@pytest.mark.e2e
def test_an_unterminated_huge_event_ends_the_stream_with_one_error_event() -> None:
    block = b"a" * 65536

    async def answer(exchange: Exchange, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        if exchange.index > 0:
            return await answer_normally(exchange, reader, writer)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        first = b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\ndata: {"x": "'
        writer.write(b"%x\r\n%s\r\n" % (len(first), first))
        while engine.written < 256 * MiB:
            writer.write(b"10000\r\n" + block + b"\r\n")
            await writer.drain()
            engine.written += len(block)
        return False

    with RawEngine(answer) as engine, routed(engine.url, limits={"sse_event_bytes": MiB}) as router:
        reply = router.ask("huge-event", stream=True)
        assert reply.status_code == 200
        sent = events(reply)
        assert json.loads(sent[0])["choices"][0]["delta"]["content"] == "hi"
        assert len(sent) == 2 and "[DONE]" not in sent
        error = json.loads(sent[1])["error"]
        assert error["code"] == "upstream_failed" and "byte limit" in error["message"]
        assert engine.wait_for(lambda: engine.requests[0].connection in engine.closed)
        assert engine.written < 64 * MiB, engine.written
        assert_recovered(router)


@pytest.mark.e2e
def test_engine_json_nested_past_the_parsers_depth_is_relayed_not_a_500() -> None:
    # The router reads `usage` from a whole answer and from each streamed event; JSON too deep for
    # Python's parser must leave it without usage, not fail the request.
    deep = b"[" * 100_000 + b"]" * 100_000

    async def answer(exchange: Exchange, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        if b'"stream":true' in exchange.body.replace(b" ", b""):
            body = b"data: " + deep + b"\n\ndata: [DONE]\n\n"
            content_type = b"text/event-stream"
        else:
            body, content_type = deep, b"application/json"
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n" % (content_type, len(body)))
        writer.write(body)
        await writer.drain()
        return True

    with RawEngine(answer) as engine, routed(engine.url) as router:
        whole = router.client.post("/chat/completions", json={"model": "m", "messages": []})
        assert whole.status_code == 200 and whole.content == deep
        streamed = router.client.post("/chat/completions", json={"model": "m", "messages": [], "stream": True})
        assert streamed.status_code == 200 and events(streamed) == [deep.decode(), "[DONE]"]


@pytest.mark.e2e
@pytest.mark.parametrize("method", ["GET", "HEAD", "DELETE"])
def test_a_bodiless_request_goes_upstream_without_a_length_or_a_body(method: str) -> None:
    # A Content-Length: 0 on a GET or HEAD is a body the method does not have (RFC 9110 §8.6):
    # some servers refuse it, and a DELETE the client sent bare must reach the engine bare too.
    async def answer(exchange: Exchange, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        if exchange.method == "POST":
            return await answer_normally(exchange, reader, writer)
        writer.write(response(body=b"" if exchange.method == "HEAD" else b'{"id": "resp-1", "deleted": true}'))
        return True

    # No search for the id's owner (router.locate): this engine answers every GET 200.
    with RawEngine(answer) as engine, routed(engine.url, responses={"locate_timeout": 0}) as router:
        target = "/v1/responses/resp-1"
        sent = router.client.request(method, "/responses/resp-1")
        assert sent.status_code == 200, sent.text
        (head,) = [head for head in engine.heads if head.split(b" ", 2)[1] == target.encode()]
        assert head.startswith(f"{method} {target} HTTP/1.1\r\n".encode())
        names = {line.split(b":", 1)[0].lower() for line in head.split(b"\r\n")[1:] if line}
        assert not names & {b"content-length", b"transfer-encoding"}, head
        assert_recovered(router)
