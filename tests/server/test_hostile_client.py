"""Hostile clients on raw sockets: what the router answers, that nothing was forwarded, and that
afterwards every gauge reads 0 and a normal request is still served.

The router runs as `specroute serve` runs it (router/listener.py: uvloop, the client limits);
the clients are raw asyncio or blocking sockets on loopback, sending what a broken or malicious
peer sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import socketserver
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from router.app import create_app
from router.config import Settings
from tests.conftest import SDK, Cluster, settings_data
from tests.servers import ServerThread
from tests.wait import until, wait_until

pytestmark = pytest.mark.e2e  # the router served on loopback in front of fake engines, hostile clients on raw sockets

MakeCluster = Callable[..., AbstractContextManager[Cluster]]
CHAT = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
GAUGES = [
    *(("specroute_in_flight_requests", {"pool": p, "backend": f"{p}-1"}) for p in ("fast", "team")),
    *(
        ("specroute_queued_requests", {"pool": p, "job_class": j})
        for p in ("fast", "team")
        for j in ("interactive", "batch")
    ),
]


# -- raw clients -------------------------------------------------------------------------------


def _request(path: str, body: bytes = b"", *, method: str = "POST", headers: dict[str, str] | None = None) -> bytes:
    fields = {"host": "router", "connection": "close", **(headers or {})}
    if method == "POST":
        fields = {"content-type": "application/json", "content-length": str(len(body)), **fields}
    head = "".join(f"{name}: {value}\r\n" for name, value in fields.items())
    return f"{method} {path} HTTP/1.1\r\n{head}\r\n".encode() + body


async def _exchange(port: int, data: bytes, *, within: float = 10) -> bytes:
    """Send `data`, then read until the router closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(within):
            return await reader.read()
    finally:
        writer.close()


def _parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    return int(status_line.split(" ")[1]), headers, body


def _error(raw: bytes, status: int, code: str) -> dict[str, Any]:
    """The router's error answer, in OpenAI's shape, on a connection it then closes."""
    got, headers, body = _parse(raw)
    assert got == status, raw[:300]
    assert headers["content-type"] == "application/json"
    error: dict[str, Any] = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["code"] == code
    return error


def _chat_body(content: str = "hi", **fields: Any) -> bytes:
    return json.dumps({**CHAT, "messages": [{"role": "user", "content": content}], **fields}).encode()


def _assert_unharmed(cluster: Cluster) -> None:
    """Every gauge back at 0, and a normal request served."""
    for name, labels in GAUGES:
        assert cluster.settled_metric(name, 0, **labels) == 0, (name, labels)
    client = cluster.client("k", timeout=30)
    answer = client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi"}])
    assert answer.choices[0].message.content


def _nothing_forwarded(cluster: Cluster) -> None:
    assert cluster.fast.requests == [] and cluster.team.requests == []


# -- the request head ------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_request_head_over_the_byte_limit_is_431_and_nothing_is_forwarded(cluster: Cluster) -> None:
    # Over the default 64 KiB (Envoy: 60 KiB; nginx: 4 x 8 KiB), in one write.
    request = _request("/v1/chat/completions", _chat_body(), headers={"x-filler": "a" * 70_000})
    _error(await _exchange(cluster.router.port, request), 431, "request_head_too_large")
    _nothing_forwarded(cluster)
    _assert_unharmed(cluster)


@pytest.mark.anyio
async def test_a_header_that_never_ends_is_cut_at_the_limit_with_431(cluster: Cluster) -> None:
    # httptools keeps an unfinished header in memory and says nothing until it ends: the router
    # counts what arrives, so one endless header is refused long before it could fill memory.
    reader, writer = await asyncio.open_connection("127.0.0.1", cluster.router.port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: router\r\nx-endless: ")
    sent = 0

    async def send_16_mb() -> None:
        nonlocal sent
        with contextlib.suppress(ConnectionError):
            while sent < 16 * 1024 * 1024:
                writer.write(b"a" * 4096)
                await writer.drain()
                sent += 4096

    sender = asyncio.create_task(send_16_mb())
    try:
        async with asyncio.timeout(10):
            # The header never ends, so any answer means the router cut it at its limit.
            raw = await reader.readuntil(b"\r\n\r\n") + await reader.read()
    finally:
        sender.cancel()
        writer.close()
    _error(raw, 431, "request_head_too_large")
    _nothing_forwarded(cluster)
    _assert_unharmed(cluster)


@pytest.mark.anyio
async def test_too_many_header_fields_is_431_and_nothing_is_forwarded(cluster: Cluster) -> None:
    fields = {f"x-h{i}": "1" for i in range(150)}  # the default limit is 100
    request = _request("/v1/chat/completions", _chat_body(), headers=fields)
    _error(await _exchange(cluster.router.port, request), 431, "request_head_too_large")
    _nothing_forwarded(cluster)
    _assert_unharmed(cluster)


@pytest.mark.anyio
async def test_bytes_that_are_not_http_get_400_in_the_openai_shape(cluster: Cluster) -> None:
    raw = await _exchange(cluster.router.port, b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 not HTTP\r\n\r\n")
    _error(raw, 400, "invalid_request")
    _nothing_forwarded(cluster)
    _assert_unharmed(cluster)


@pytest.mark.anyio
async def test_a_head_sent_a_byte_at_a_time_is_answered_408_and_closed_at_the_head_timeout(
    make_cluster: MakeCluster,
) -> None:
    with make_cluster(timeouts={"request_head": 1}) as cluster:
        reader, writer = await asyncio.open_connection("127.0.0.1", cluster.router.port)
        sent = 0

        async def drip() -> None:
            nonlocal sent
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nx-slow: ")
            with contextlib.suppress(ConnectionError):
                for _ in range(300):  # 30 s of head, were it allowed to go on
                    writer.write(b"a")
                    await writer.drain()
                    sent += 1
                    await asyncio.sleep(0.1)

        dripping = asyncio.create_task(drip())
        try:
            async with asyncio.timeout(15):
                raw = await reader.read()
        finally:
            dripping.cancel()
            writer.close()
        _error(raw, 408, "head_timeout")
        assert sent < 300  # cut off, not finished
        _nothing_forwarded(cluster)
        _assert_unharmed(cluster)


@pytest.mark.anyio
async def test_idle_connections_are_closed_and_a_normal_request_is_served_meanwhile(
    make_cluster: MakeCluster,
) -> None:
    with make_cluster(timeouts={"request_head": 2, "keep_alive": 1}) as cluster:
        port = cluster.router.port
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(300)]
        # One connection that was served and then left idle: closed after keep_alive.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_request("/healthz", method="GET", headers={"connection": "keep-alive"}))
        status_line = await reader.readuntil(b"\r\n\r\n")
        assert status_line.startswith(b"HTTP/1.1 200")
        idle.append((reader, writer))

        await asyncio.to_thread(_assert_unharmed, cluster)  # most likely while the sockets are open

        async def closed_by_router(reader: asyncio.StreamReader) -> bool:
            async with asyncio.timeout(20):
                await reader.read()  # the rest of the healthz answer, then EOF
            return reader.at_eof()

        results = await asyncio.gather(*(closed_by_router(r) for r, _ in idle))
        assert all(results)
        for _, w in idle:
            w.close()
        _assert_unharmed(cluster)


@pytest.mark.anyio
async def test_connections_past_the_cap_are_refused_at_once_with_503(make_cluster: MakeCluster) -> None:
    with make_cluster(limits={"max_connections": 20}, timeouts={"request_head": 60}) as cluster:
        port = cluster.router.port
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(20)]

        # The router may take the idle connections a moment after the kernel did: probe until
        # it holds all 20 (a probe answered 200 went in before some of them, and left).
        async def healthz() -> int:
            status, _, _ = _parse(await _exchange(port, _request("/healthz", method="GET")))
            return status

        async def refused() -> bool:
            return await healthz() == 503

        await until(refused, timeout=10, interval=0, message="the router holding all 20 idle connections")
        raw = await _exchange(port, _request("/v1/chat/completions", _chat_body()))
        _error(raw, 503, "too_many_connections")
        assert _parse(raw)[1]["retry-after"] == "1"
        _nothing_forwarded(cluster)

        for _, writer in idle:
            writer.close()

        async def served() -> bool:
            return await healthz() == 200

        await until(served, timeout=10, interval=0, message="served once the idle connections closed")
        await asyncio.to_thread(_assert_unharmed, cluster)


# -- what a request asks for -----------------------------------------------------------------


@pytest.mark.anyio
async def test_an_upgrade_request_with_a_body_is_refused_at_once_and_not_held(make_cluster: MakeCluster) -> None:
    with make_cluster(timeouts={"client_body": 5}) as cluster:
        request = _request(
            "/v1/chat/completions",
            _chat_body(),
            headers={"connection": "Upgrade", "upgrade": "websocket", "sec-websocket-version": "13"},
        )
        started = time.monotonic()
        raw = await _exchange(cluster.router.port, request, within=30)
        assert time.monotonic() - started < 5  # answered, not held until the body timeout
        _error(raw, 400, "upgrade_not_supported")
        _nothing_forwarded(cluster)

        # `Upgrade` without `Connection: upgrade` asks for nothing: served, and not forwarded.
        plain = _request("/v1/chat/completions", _chat_body(), headers={"upgrade": "websocket"})
        raw = await _exchange(cluster.router.port, plain)
        assert _parse(raw)[0] == 200
        assert "upgrade" not in cluster.fast.requests[-1].headers
        _assert_unharmed(cluster)


@pytest.mark.anyio
@pytest.mark.parametrize("depth", [65, 1_000, 100_000])
async def test_deeply_nested_json_is_400_invalid_json_on_v1_and_admin(
    make_cluster: MakeCluster, monkeypatch: pytest.MonkeyPatch, depth: int
) -> None:
    monkeypatch.setenv("SPECROUTE_TEST_ADMIN_KEY", "admin-secret")
    with make_cluster(auth={"admin_key_env": "SPECROUTE_TEST_ADMIN_KEY"}) as cluster:
        nested = "[" * depth + "]" * depth
        body = f'{{"model": "test-model", "messages": {nested}}}'.encode()
        raw = await _exchange(cluster.router.port, _request("/v1/chat/completions", body))
        _error(raw, 400, "invalid_json")
        _nothing_forwarded(cluster)

        admin = {"authorization": "Bearer admin-secret"}
        body = f'{{"pool": {nested}}}'.encode()
        raw = await _exchange(cluster.router.port, _request("/admin/drain", body, headers=admin))
        _error(raw, 400, "invalid_json")
        status = (await asyncio.to_thread(httpx.get, cluster.router.url + "/router/status")).json()
        assert not any(b["draining"] for pool in status["pools"].values() for b in pool["backends"].values())
        _assert_unharmed(cluster)


@pytest.mark.anyio
async def test_prompts_that_made_the_classifier_backtrack_are_served_and_others_are_not_held_up(
    cluster: Cluster,
) -> None:
    worst = ["a" * 8190 + "(", "\n" * 8191 + "x", "\n\t" * 4095 + "x", "a(" * 4096]
    requests = [_request("/v1/chat/completions", _chat_body(text)) for text in worst * 4]
    before = _prose_decisions(cluster)
    started = time.monotonic()
    answers = await asyncio.gather(
        *(_exchange(cluster.router.port, request) for request in requests),
        _exchange(cluster.router.port, _request("/healthz", method="GET")),
    )
    # A guard with a wide margin: a backtracking regex engine spends 0.2-1 s of event-loop CPU on
    # each of these 16 prompts; RE2 spends microseconds (docs/benchmarks.md, content detection).
    assert time.monotonic() - started < 5
    assert [_parse(answer)[0] for answer in answers] == [200] * 17
    assert _prose_decisions(cluster) - before == 16
    _assert_unharmed(cluster)


def _prose_decisions(cluster: Cluster) -> float:
    return sum(
        sample.value
        for metric in cluster.registry.collect()
        for sample in metric.samples
        if sample.name == "specroute_route_decisions_total" and sample.labels["content"] == "prose"
    )


# -- the client's address --------------------------------------------------------------------


@pytest.mark.parametrize(("trusted", "distinct"), [(None, True), (["10.1.2.3"], False)])
def test_forwarded_addresses_are_distinct_clients_only_from_a_trusted_proxy(
    make_cluster: MakeCluster, trusted: list[str] | None, distinct: bool
) -> None:
    """Two streams from one forwarded address make it a batch client (threshold 2); a third
    address is a new client if, and only if, the peer is trusted to name it (by default: loopback)."""
    listen = {} if trusted is None else {"listen": {"forwarded_allow_ips": trusted}}
    classify = {"batch_inflight_threshold": 2, "burst_hold_seconds": 0}
    with make_cluster(classify=classify, **listen) as cluster:
        cluster.fast.stall_after = 1  # the two streams stay in flight until closed
        port = cluster.router.port
        streams = []
        for _ in range(2):
            sock = socket.create_connection(("127.0.0.1", port))
            request = _request(
                "/v1/chat/completions", _chat_body(stream=True), headers={"x-forwarded-for": "192.0.2.1"}
            )
            sock.sendall(request)
            streams.append(sock)
        wait_until(lambda: cluster.fast.open >= 2, timeout=10, message="the two streams started")

        def reason(address: str) -> str:
            answer = httpx.post(cluster.base_url + "/chat/completions", json=CHAT, headers={"x-forwarded-for": address})
            assert answer.status_code == 200
            return answer.headers["x-route-reason"]

        assert reason("192.0.2.7") == ("default" if distinct else "client-in-flight")
        assert reason("192.0.2.1") == "client-in-flight"
        for sock in streams:
            sock.close()
        _assert_unharmed(cluster)


# -- clients that stop reading ---------------------------------------------------------------


class FloodEngine:
    """An engine that streams `size`-byte events, `pace` seconds apart (0: as fast as its client
    takes them), for max_tokens events."""

    def __init__(self, *, size: int = 16_384, pace: float = 0.0) -> None:
        self.started = 0
        self.cancelled = 0
        self._size = size
        self._pace = pace

    def app(self) -> Starlette:
        return Starlette(
            routes=[Route("/v1/chat/completions", self._chat, methods=["POST"]), Route("/health", self._health)]
        )

    async def _health(self, request: Request) -> Response:
        return Response()

    async def _chat(self, request: Request) -> StreamingResponse:
        count = (await request.json())["max_tokens"]
        return StreamingResponse(self._events(count), media_type="text/event-stream")

    async def _events(self, count: int) -> AsyncIterator[str]:
        self.started += 1
        finished = False
        try:
            for _ in range(count):
                chunk = {
                    "id": "c",
                    "object": "chat.completion.chunk",
                    "created": 0,
                    "model": "test-model",
                    "choices": [{"index": 0, "delta": {"content": "x" * self._size}}],
                }
                yield f"data: {json.dumps(chunk)}\n\n"
                await asyncio.sleep(self._pace)  # as an engine waits for its next token: a cancel can land
            yield "data: [DONE]\n\n"
            finished = True
        finally:
            if not finished:
                self.cancelled += 1


def _metric_sum(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """The sum over the series that carry these labels (whatever their others)."""
    return sum(
        sample.value
        for metric in registry.collect()
        for sample in metric.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


def test_a_client_that_stops_reading_is_cut_off_after_client_write_and_frees_its_slot(sdk: SDK) -> None:
    engine = FloodEngine()
    registry = CollectorRegistry()
    with ServerThread(engine.app()) as upstream:
        data = settings_data(upstream.url, upstream.url, timeouts={"client_write": 1})
        for pool in data["pools"].values():
            next(iter(pool["backends"].values()))["max_concurrency"] = 1
        app = create_app(Settings(**data), registry=registry)
        with ServerThread(app, fast=True) as router:
            # The client asks for an endless stream and never reads; its receive buffer is small.
            reader = socket.socket()
            reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            reader.connect(("127.0.0.1", router.port))
            pinned = {"x-route-pool": "fast"}
            reader.sendall(_request("/v1/chat/completions", _chat_body(stream=True, max_tokens=10**9), headers=pinned))
            wait_until(lambda: engine.started == 1, timeout=10, message="the request at the engine")

            # The next client waits for the one slot, and gets it once the first is cut off.
            client = sdk(router.url, "k", timeout=60, default_headers=pinned)
            stream = client.chat.completions.create(
                model="test-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
            )
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "x" * 16_384 * 3
            wait_until(
                lambda: engine.cancelled == 1, timeout=10, message="cancelled upstream"
            )  # the first request was cancelled upstream

            def value(name: str, **labels: str) -> float:
                return _metric_sum(registry, name, **labels)

            wait_until(
                lambda: value("specroute_in_flight_requests", pool="fast", backend="fast-1") == 0,
                timeout=10,
                message="nothing in flight",
            )
            assert value("specroute_queued_requests", pool="fast", job_class="interactive") == 0
            assert (
                value("specroute_requests_total", pool="fast", backend="fast-1", job_class="interactive", status="499")
                == 1
            )
            # The router aborted the connection: what it had sent, then the end or a reset.
            reader.settimeout(10)
            received = 0
            with contextlib.suppress(ConnectionResetError):
                while (piece := reader.recv(1 << 20)) and received < 256 * 1024 * 1024:
                    received += len(piece)
            assert received < 256 * 1024 * 1024
            reader.close()


def test_clients_that_stop_reading_a_paced_stream_lose_their_slots_to_the_next_request(sdk: SDK) -> None:
    # Tokens at an engine's pace fill a client's receive buffer in seconds, but the megabytes of
    # a loopback socket's send buffer in minutes: the router must not wait for those to fill
    # before it counts timeouts.client_write (it kept both slots past the queue timeout).
    engine = FloodEngine(size=64, pace=0.004)
    registry = CollectorRegistry()
    with ServerThread(engine.app()) as upstream:
        data = settings_data(upstream.url, upstream.url, timeouts={"client_write": 1})
        for pool in data["pools"].values():
            pool["queue_timeout"] = 20
            next(iter(pool["backends"].values()))["max_concurrency"] = 2
        app = create_app(Settings(**data), registry=registry)
        with ServerThread(app, fast=True) as router:
            pinned = {"x-route-pool": "fast"}
            stalled = []
            for _ in range(2):  # default receive buffers, never read
                reader = socket.create_connection(("127.0.0.1", router.port))
                reader.sendall(
                    _request("/v1/chat/completions", _chat_body(stream=True, max_tokens=10**9), headers=pinned)
                )
                stalled.append(reader)
            wait_until(lambda: engine.started == 2, timeout=10, message="both requests at the engine")

            client = sdk(router.url, "k", timeout=60, default_headers=pinned)
            stream = client.chat.completions.create(
                model="test-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
            )
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "x" * 64 * 3
            wait_until(lambda: engine.cancelled == 2, timeout=10, message="both stalled requests cancelled upstream")
            served = {"pool": "fast", "backend": "fast-1", "job_class": "interactive"}
            assert _metric_sum(registry, "specroute_requests_total", **served, status="499") == 2
            for reader in stalled:
                reader.close()


# -- the path, byte for byte -----------------------------------------------------------------


class RecordingEngine(socketserver.ThreadingTCPServer):
    """An engine on a raw socket that records each request line exactly as it arrives."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _RecordingHandler)
        self.lines: list[bytes] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _RecordingHandler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        line = self.rfile.readline()
        length = 0
        while (header := self.rfile.readline()) not in (b"\r\n", b""):
            name, _, value = header.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        self.rfile.read(length)
        assert isinstance(self.server, RecordingEngine)
        if line.startswith(b"POST"):
            self.server.lines.append(line)
        answer = json.dumps(
            {
                "id": "c",
                "object": "chat.completion",
                "created": 0,
                "model": "test-model",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            }
        ).encode()
        status = b"404 Not Found" if b" /metrics " in line else b"200 OK"
        head = b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
        self.wfile.write(head % (status, len(answer)) + answer)


class Recorded:
    """The router in front of a RecordingEngine (both pools)."""

    def __init__(self, engine: RecordingEngine, router: ServerThread, registry: CollectorRegistry) -> None:
        self.engine = engine
        self.router = router
        self.registry = registry

    def assert_unharmed(self) -> None:
        for name, labels in GAUGES:
            assert self.registry.get_sample_value(name, labels) == 0, (name, labels)
        with openai.OpenAI(base_url=self.router.url + "/v1", api_key="k", max_retries=0, timeout=30) as client:
            answer = client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi"}])
        assert answer.choices[0].message.content == "ok"
        assert self.engine.lines[-1] == b"POST /v1/chat/completions HTTP/1.1\r\n"


@pytest.fixture
def recorded() -> Iterator[Recorded]:
    engine = RecordingEngine()
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    registry = CollectorRegistry()
    try:
        app = create_app(Settings(**settings_data(engine.url, engine.url)), registry=registry)
        with ServerThread(app, fast=True) as router:
            yield Recorded(engine, router, registry)
    finally:
        engine.shutdown()
        engine.server_close()


@pytest.mark.anyio
@pytest.mark.parametrize(
    "target",
    [
        "/v1/chat%2Fcompletions",
        "/v1/chat/completions%20x",
        "/v1/chat/completions%3Fx=1?a=%3F&b=%20&c=%2F",
        "/v1/chat/completions?q=%00",  # in the query it is data, and stays encoded
    ],
)
async def test_the_path_and_query_reach_the_engine_byte_for_byte(recorded: Recorded, target: str) -> None:
    raw = await _exchange(recorded.router.port, _request(target, _chat_body()))
    assert _parse(raw)[0] == 200
    assert recorded.engine.lines == [f"POST {target} HTTP/1.1\r\n".encode()]
    await asyncio.to_thread(recorded.assert_unharmed)


@pytest.mark.anyio
@pytest.mark.parametrize(
    "target",
    [
        "/v1/%2e%2e/admin/drain",
        "/v1/%2E%2E/admin/drain",
        "/v1/../admin/drain",
        "/v1/chat/%2e/completions",
        "/v1/chat%2F..%2F..%2Fadmin",
        "/v1/chat/completions%00",
        "/v1/chat/completions%0dX-Injected:%201",
        "/v1/chat/completions%1b%5b2J",  # an escape sequence for whoever reads the engine's log
    ],
)
async def test_a_path_with_a_dot_segment_or_a_control_character_is_400_invalid_path(
    recorded: Recorded, target: str
) -> None:
    _error(await _exchange(recorded.router.port, _request(target, _chat_body())), 400, "invalid_path")
    assert recorded.engine.lines == []
    await asyncio.to_thread(recorded.assert_unharmed)
