"""Every error a client can cause: status, OpenAI error shape, and nothing forwarded or left open."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from starlette.types import Message

from tests.conftest import Cluster

pytestmark = pytest.mark.e2e  # the router served on loopback in front of fake engines


def _assert_openai_error(response: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if code is not None:
        assert error["code"] == code
    return error


def _nothing_forwarded(cluster: Cluster) -> None:
    assert cluster.fast.requests == []
    assert cluster.team.requests == []
    assert cluster.metric("specroute_in_flight_requests", pool="fast", backend="fast-1") == 0
    assert cluster.metric("specroute_in_flight_requests", pool="team", backend="team-1") == 0


def test_malformed_json_is_400(cluster: Cluster) -> None:
    response = httpx.post(
        cluster.base_url + "/chat/completions", content=b'{"model": "x",', headers={"content-type": "application/json"}
    )
    _assert_openai_error(response, 400, "invalid_json")
    _nothing_forwarded(cluster)


def test_json_that_is_not_an_object_is_400(cluster: Cluster) -> None:
    response = httpx.post(cluster.base_url + "/chat/completions", content=b"[1, 2]")
    _assert_openai_error(response, 400, "invalid_json")
    _nothing_forwarded(cluster)


def test_unknown_pool_header_is_400(cluster: Cluster) -> None:
    response = httpx.post(
        cluster.base_url + "/completions", json={"model": "test-model"}, headers={"X-Route-Pool": "gpu9"}
    )
    error = _assert_openai_error(response, 400, "unknown_pool")
    assert error["param"] == "x-route-pool"
    _nothing_forwarded(cluster)


def test_unknown_job_type_is_400_through_the_sdk(cluster: Cluster) -> None:
    client = cluster.client("k", default_headers={"X-Job-Type": "urgent"})
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="test-model", prompt="x")
    assert caught.value.code == "unknown_job_type"
    _nothing_forwarded(cluster)


def test_body_over_limit_is_413_by_content_length(make_cluster: Any) -> None:
    with make_cluster(max_body_bytes=1000) as cluster:
        response = httpx.post(cluster.base_url + "/completions", json={"model": "test-model", "prompt": "x" * 2000})
        _assert_openai_error(response, 413, "body_too_large")
        _nothing_forwarded(cluster)


def test_body_over_limit_is_413_when_chunked(make_cluster: Any) -> None:
    def body() -> Iterator[bytes]:
        yield b'{"model": "test-model", "prompt": "'
        for _ in range(50):
            yield b"x" * 100
        yield b'"}'

    with make_cluster(max_body_bytes=1000) as cluster:
        response = httpx.post(cluster.base_url + "/completions", content=body())
        _assert_openai_error(response, 413, "body_too_large")
        _nothing_forwarded(cluster)


def test_slow_body_is_408(make_cluster: Any) -> None:
    with (
        make_cluster(timeouts={"client_body": 0.3}) as cluster,
        socket.create_connection(("127.0.0.1", cluster.router.port)) as sock,
    ):
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"model":'
        )
        sock.settimeout(30)
        started = time.monotonic()
        answer = sock.recv(65536)
        assert time.monotonic() - started < 10  # at the body timeout, not the socket's
        assert answer.startswith(b"HTTP/1.1 408")
        assert b'"code":"body_timeout"' in answer.replace(b" ", b"")
        _nothing_forwarded(cluster)


def test_unknown_path_is_404(cluster: Cluster) -> None:
    _assert_openai_error(httpx.get(cluster.router.url + "/nope"), 404)
    _assert_openai_error(httpx.post(cluster.router.url + "/v2/chat/completions", json={}), 404)
    _nothing_forwarded(cluster)


def test_wrong_method_is_405(cluster: Cluster) -> None:
    response = httpx.put(cluster.base_url + "/chat/completions")
    _assert_openai_error(response, 405)
    assert set(response.headers["allow"].split(", ")) == {"DELETE", "GET", "HEAD", "POST"}
    # The router's own list of models: no other method is forwarded.
    for method in ("DELETE", "POST"):
        response = httpx.request(method, cluster.base_url + "/models")
        _assert_openai_error(response, 405)
        assert response.headers["allow"] == "GET, HEAD"
    response = httpx.delete(cluster.base_url + "/files")  # the Batch API's, on by default
    _assert_openai_error(response, 405)
    assert response.headers["allow"] == "GET, HEAD, POST"
    _nothing_forwarded(cluster)


def _dead_url(placeholder: socket.socket) -> str:
    placeholder.bind(("127.0.0.1", 0))
    return f"http://127.0.0.1:{placeholder.getsockname()[1]}"  # bound, never listening


def test_unreachable_backend_is_502_then_503(make_cluster: Any) -> None:
    with socket.socket() as placeholder:
        dead = {"fast": {"backends": {"fast-1": {"url": _dead_url(placeholder)}}}}
        with make_cluster(pools=dead, routing={"mode": "static"}, retries={"attempts": 1}) as cluster:
            # The startup health check found it down: fail fast, with a hint when to retry.
            pinned = {"X-Route-Pool": "fast"}  # else interactive work leaves a dead pool
            response = httpx.post(cluster.base_url + "/completions", json={"model": "test-model"}, headers=pinned)
            _assert_openai_error(response, 503, "pool_unavailable")
            assert response.headers["retry-after"].isdigit()
            assert httpx.get(cluster.router.url + "/readyz").json()["backends"]["fast-1"] is False
            # Pretend the checker saw it up: the request itself now meets the dead port.
            cluster.app.state.router.pools["fast"].backends[0].outlier.healthy = True
            response = httpx.post(cluster.base_url + "/completions", json={"model": "test-model"}, headers=pinned)
            _assert_openai_error(response, 502, "upstream_unreachable")
            assert (
                cluster.settled_metric(
                    "specroute_upstream_errors_total", 1, pool="fast", backend="fast-1", kind="connect"
                )
                == 1
            )


def test_interactive_work_spills_off_a_dead_speculative_pool(make_cluster: Any) -> None:
    with socket.socket() as placeholder:
        dead = {"fast": {"backends": {"fast-1": {"url": _dead_url(placeholder)}}}}
        with make_cluster(pools=dead) as cluster:
            response = httpx.post(cluster.base_url + "/completions", json={"model": "test-model", "prompt": "x"})
            assert response.status_code == 200
            assert response.headers["x-route-pool"] == "team"
            assert response.headers["x-route-reason"] == "spill:spec-down"


def test_a_bug_on_the_request_path_is_answered_as_an_openai_error(cluster: Cluster) -> None:
    """A forwarded request goes to the pipeline past Starlette's middleware, so the
    pipeline itself answers its own bugs: a 500 in OpenAI's shape (Starlette's was plain text),
    and the exception goes on to the server to be logged. Here the server's `receive` breaks."""

    async def receive() -> Message:
        raise RuntimeError("the server broke")

    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "http_version": "1.1",
        "method": "POST",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"x-request-id", b"bug-1")],
        "client": ("127.0.0.1", 40000),
    }
    with pytest.raises(RuntimeError, match="the server broke"):
        asyncio.run(cluster.app(scope, receive, send))
    start, body = sent
    assert start["status"] == 500
    assert (b"content-type", b"application/json") in start["headers"]
    assert (b"x-request-id", b"bug-1") in start["headers"]
    error = json.loads(body["body"])["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "internal_error"
