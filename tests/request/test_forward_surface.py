"""The rest of the OpenAI surface through the router: GET and DELETE under /v1/, bodies that are
not JSON (multipart uploads), the Responses API's stored responses on the backend that made them,
and Retry-After from what a pool has measured. The official `openai` SDK as the client, fake
engines (tests/fake_engine.py) behind, raw sockets for what a hostile client sends.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any

import httpx
import openai
import pytest

from router.clock import ManualClock
from tests.conftest import Cluster
from tests.fake_engine import FakeEngine, Seen
from tests.server.test_hostile_client import _assert_unharmed, _error, _exchange, _nothing_forwarded, _parse
from tests.wait import wait_until

pytestmark = pytest.mark.e2e  # the router served on loopback in front of fake engines

MakeCluster = Callable[..., AbstractContextManager[Cluster]]
MODEL = "test-model"
BOUNDARY = "specroute-test-boundary"


def _client(cluster: Cluster) -> openai.OpenAI:
    return cluster.client("k", timeout=30)


def _probes(engine: FakeEngine) -> list[Seen]:
    """What the router asked an engine to find a stored response it did not remember (router.responses.locate)."""
    return [seen for seen in engine.requests if seen.headers.get("x-request-id", "").endswith("-locate")]


def _not_probes(engine: FakeEngine) -> list[Seen]:
    return [seen for seen in engine.requests if not seen.headers.get("x-request-id", "").endswith("-locate")]


def _all_requests(cluster: Cluster) -> list[tuple[str, str]]:
    engines = [cluster.fast, *cluster.more_fast, cluster.team]
    return [(seen.method, seen.path) for engine in engines for seen in engine.requests]


# -- GET and DELETE ----------------------------------------------------------------------------


def test_models_retrieve_is_answered_from_the_routers_catalog(cluster: Cluster) -> None:
    # vLLM serves no GET /v1/models/{id}: the router answers it from the list it keeps.
    client = _client(cluster)
    model = client.models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "fake")
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such-model")
    assert missing.value.code == "model_not_found" and missing.value.type == "invalid_request_error"
    assert "no-such-model" in missing.value.message
    assert [m.id for m in client.models.list()] == [MODEL]
    assert _all_requests(cluster) == []  # nothing forwarded


@pytest.mark.anyio
async def test_a_model_nobody_serves_is_404_in_openais_shape(cluster: Cluster) -> None:
    raw = await _exchange(cluster.router.port, _raw_request("GET", "/v1/models/org/no-such-model"))
    error = _error(raw, 404, "model_not_found")
    assert error["type"] == "invalid_request_error" and "org/no-such-model" in error["message"]
    _nothing_forwarded(cluster)


def test_another_get_under_v1_is_forwarded(cluster: Cluster) -> None:
    job = _client(cluster).fine_tuning.jobs.retrieve("ftjob-1")
    assert (job.id, job.object) == ("ftjob-1", "fine_tuning.job")
    assert _all_requests(cluster) == [("GET", "/v1/fine_tuning/jobs/ftjob-1")]


# -- bodies that are not JSON -------------------------------------------------------------------


def test_an_audio_upload_is_forwarded_byte_for_byte(cluster: Cluster) -> None:
    audio = bytes(range(256)) * 40  # not UTF-8, not JSON
    answer = _client(cluster).audio.transcriptions.create(model=MODEL, file=("clip.wav", audio, "audio/wav"))
    (seen,) = [s for s in [*cluster.fast.requests, *cluster.team.requests]]
    assert seen.method == "POST" and seen.path == "/v1/audio/transcriptions"
    assert seen.headers["content-type"].startswith("multipart/form-data; boundary=")
    assert audio in seen.raw
    assert answer.text == f"{len(seen.raw)} bytes heard"


def test_an_upload_a_rule_rewrites_the_model_of_goes_as_it_came(make_cluster: MakeCluster) -> None:
    # The router reads no multipart body: a rule's `rewrite_model` cannot reach inside one, and
    # must not replace it (it once went as `{"model": ...}` alone).
    rules = [{"name": "etl", "job": "batch", "match": {"api_key": "etl-key"}, "rewrite_model": MODEL}]
    audio = bytes(range(256)) * 40
    with make_cluster(classify={"rules": rules}) as cluster:
        client = cluster.client("etl-key", timeout=30)
        raw = client.audio.transcriptions.with_raw_response.create(model="other", file=("a.wav", audio, "audio/wav"))
        assert raw.headers["x-route-reason"] == "rule:etl"
        (seen,) = [*cluster.fast.requests, *cluster.team.requests]
        assert audio in seen.raw and b'name="model"\r\n\r\nother\r\n' in seen.raw
        assert raw.parse().text == f"{len(seen.raw)} bytes heard"


def _multipart(payload: bytes) -> bytes:
    return (
        (
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
            "Content-Type: audio/wav\r\n\r\n"
        ).encode()
        + payload
        + f'\r\n--{BOUNDARY}\r\nContent-Disposition: form-data; name="model"\r\n\r\n{MODEL}\r\n'.encode()
        + f"--{BOUNDARY}--\r\n".encode()
    )


def _raw_request(method: str, target: str, body: bytes = b"", **headers: str) -> bytes:
    fields = {"host": "router", "connection": "close", **({"content-length": str(len(body))} if body else {})}
    fields.update({name.replace("_", "-"): value for name, value in headers.items()})
    head = "".join(f"{name}: {value}\r\n" for name, value in fields.items())
    return f"{method} {target} HTTP/1.1\r\n{head}\r\n".encode() + body


@pytest.mark.anyio
async def test_raw_multipart_reaches_the_engine_exactly_and_is_never_parsed(cluster: Cluster) -> None:
    # Bytes that are no JSON and not even well-formed multipart inside: the engine's to judge.
    body = _multipart(b"\x00\xff{not json" * 100)
    request = _raw_request(
        "POST", "/v1/audio/transcriptions", body, content_type=f"multipart/form-data; boundary={BOUNDARY}"
    )
    status, headers, answer = _parse(await _exchange(cluster.router.port, request))
    assert status == 200, answer
    assert "x-route-backend" in headers
    (seen,) = [*cluster.fast.requests, *cluster.team.requests]
    assert seen.raw == body
    assert seen.headers["content-type"] == f"multipart/form-data; boundary={BOUNDARY}"
    _assert_unharmed(cluster)


def _total(cluster: Cluster, name: str) -> float:
    return sum(s.value for f in cluster.registry.collect() for s in f.samples if s.name == name)


@pytest.mark.anyio
async def test_a_streamed_transcription_is_relayed_as_it_arrives(cluster: Cluster) -> None:
    # `stream=true` is a form field the router never reads: the engine's text/event-stream decides.
    gate = threading.Event()
    for engine in (cluster.fast, cluster.team):
        engine.stream_gate = gate  # each holds its stream after the first event until the test has seen it
    body = _multipart(b"\x00audio")
    body = body.replace(
        f"--{BOUNDARY}--".encode(),
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="stream"\r\n\r\ntrue\r\n--{BOUNDARY}--'.encode(),
    )
    request = _raw_request(
        "POST", "/v1/audio/transcriptions", body, content_type=f"multipart/form-data; boundary={BOUNDARY}"
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", cluster.router.port)
    try:
        writer.write(request)
        await writer.drain()
        async with asyncio.timeout(10):
            first = b""
            while b"bytes" not in first:  # the first event, while the engine is still held
                piece = await reader.read(65536)
                assert piece, first
                first += piece
            assert not gate.is_set()
            gate.set()
            rest = await reader.read()
    finally:
        writer.close()
    status, headers, answer = _parse(first + rest)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in answer.decode().split("\n") if line.startswith("data: ")]
    text = "".join(c["delta"]["content"] for e in events[:-1] for c in json.loads(e)["choices"])
    assert text.endswith("bytes heard") and events[-1] == "[DONE]"
    # Accounted as a stream: a first token, and the usage the engine reported.
    wait_until(lambda: _total(cluster, "specroute_completion_tokens_total") == 2, message="usage recorded")
    assert _total(cluster, "specroute_time_to_first_token_seconds_count") == 1
    _assert_unharmed(cluster)


@pytest.mark.anyio
async def test_a_multipart_body_over_the_limit_is_413_declared_or_chunked(make_cluster: MakeCluster) -> None:
    with make_cluster(max_body_bytes=2000) as cluster:
        body = _multipart(b"a" * 5000)
        kind = f"multipart/form-data; boundary={BOUNDARY}"
        declared = _raw_request("POST", "/v1/audio/transcriptions", body, content_type=kind)
        _error(await _exchange(cluster.router.port, declared), 413, "body_too_large")
        # No Content-Length: found over the limit as it arrives.
        chunks = b"".join(
            b"%x\r\n%s\r\n" % (len(body[i : i + 1000]), body[i : i + 1000]) for i in range(0, len(body), 1000)
        )
        chunked = _raw_request("POST", "/v1/audio/transcriptions", content_type=kind, transfer_encoding="chunked")
        _error(await _exchange(cluster.router.port, chunked + chunks + b"0\r\n\r\n"), 413, "body_too_large")
        _nothing_forwarded(cluster)
        _assert_unharmed(cluster)


@pytest.mark.anyio
async def test_a_delete_with_a_body_is_forwarded_as_it_came(cluster: Cluster) -> None:
    body = b"\x01 a body no DELETE needs \xfe"
    request = _raw_request("DELETE", "/v1/responses/resp-nope", body, content_type="application/octet-stream")
    status, _, answer = _parse(await _exchange(cluster.router.port, request))
    assert status == 404 and json.loads(answer)["error"]["code"] == 404  # the engine's answer
    # The id's owner was asked for first (router.locate), with a bare GET; the DELETE went as it came.
    (seen,) = [*_not_probes(cluster.fast), *_not_probes(cluster.team)]
    assert (seen.method, seen.path, seen.raw) == ("DELETE", "/v1/responses/resp-nope", body)
    assert {(probe.method, probe.raw) for probe in _probes(cluster.fast) + _probes(cluster.team)} == {("GET", b"")}
    _assert_unharmed(cluster)


USAGE_ASKED = {"include_usage": True, "continuous_usage_stats": False}


@pytest.mark.anyio
async def test_a_stream_goes_to_the_engine_in_the_clients_bytes_with_the_usage_request_appended(
    cluster: Cluster,
) -> None:
    # The client's own spacing, escapes and UTF-8 go on as they came: the field the router adds
    # (the stream's token counts) is appended to them, not the body decoded and encoded anew.
    body = b'{ "model" : "test-model", "messages": [{"role": "user", "content": "caf\\u00e9 \xe2\x82\xac"}],\n'
    body += b' "max_tokens": 3, "stream": true }\r\n'
    request = _raw_request("POST", "/v1/chat/completions", body, content_type="application/json")
    status, _, answer = _parse(await _exchange(cluster.router.port, request))
    assert status == 200 and b"data: [DONE]\n\n" in answer, answer
    assert b'"usage"' not in answer  # asked for by the router, not the client: dropped
    (seen,) = [*cluster.fast.requests, *cluster.team.requests]
    appended = b',"stream_options":{"include_usage":true,"continuous_usage_stats":false}}'
    assert seen.raw == body.rstrip()[:-1] + appended
    assert seen.body == {**json.loads(body), "stream_options": USAGE_ASKED}
    _assert_unharmed(cluster)


@pytest.mark.anyio
@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-32-le"])
async def test_a_body_in_another_unicode_encoding_goes_to_the_engine_in_utf_8(cluster: Cluster, encoding: str) -> None:
    # JSON in UTF-16 or 32 parses too (RFC 8259 asks UTF-8 only of what crosses networks): bytes
    # appended to it would make it unreadable, so it is encoded anew, as JSON in UTF-8.
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "caf\u00e9"}], "max_tokens": 3, "stream": True}
    body = json.dumps(payload).encode(encoding)
    request = _raw_request("POST", "/v1/chat/completions", body, content_type="application/json")
    status, _, answer = _parse(await _exchange(cluster.router.port, request))
    assert status == 200, answer
    (seen,) = [*cluster.fast.requests, *cluster.team.requests]
    assert seen.raw.isascii() and json.loads(seen.raw) == {**payload, "stream_options": USAGE_ASKED}
    _assert_unharmed(cluster)


@pytest.mark.anyio
async def test_a_get_with_a_huge_query_is_forwarded_within_the_head_limit_and_431_past_it(cluster: Cluster) -> None:
    target = "/v1/fine_tuning/jobs/ftjob-1?q=" + "a" * 12_000
    status, _, answer = _parse(await _exchange(cluster.router.port, _raw_request("GET", target)))
    assert status == 200 and json.loads(answer)["id"] == "ftjob-1"
    assert [seen.path for seen in cluster.fast.requests + cluster.team.requests] == ["/v1/fine_tuning/jobs/ftjob-1"]
    cluster.fast.requests.clear()
    cluster.team.requests.clear()
    over = "/v1/fine_tuning/jobs/ftjob-1?q=" + "a" * 70_000  # over the default 64 KiB request head
    _error(await _exchange(cluster.router.port, _raw_request("GET", over)), 431, "request_head_too_large")
    _nothing_forwarded(cluster)
    _assert_unharmed(cluster)


@pytest.mark.anyio
async def test_a_forwarded_get_with_a_json_body_that_is_not_json_is_not_parsed(cluster: Cluster) -> None:
    # A GET's body is never read as JSON: no 400 invalid_json for what the router never looks at.
    request = _raw_request("GET", "/v1/fine_tuning/jobs/ftjob-1", b"{{{", content_type="application/json")
    status, _, _ = _parse(await _exchange(cluster.router.port, request))
    assert status == 200
    _assert_unharmed(cluster)


# -- the Responses API: back to the backend that made the response -------------------------------


@pytest.fixture
def two_backends(make_cluster: MakeCluster) -> Iterator[tuple[Cluster, ManualClock]]:
    clock = ManualClock()
    with make_cluster(
        fast_backends=2, live_clock=clock, routing={"mode": "static"}, responses={"affinity_seconds": 60}
    ) as cluster:
        cluster.fast.name, cluster.more_fast[0].name = "a", "b"
        yield cluster, clock


def _on_fast_2(cluster: Cluster, make: Callable[[], Any]) -> Any:
    """Made while fast-1 is drained, so on fast-2; fast-1, first and idle, is where anything else goes."""
    router = cluster.app.state.router
    router.set_draining(backend="fast-1", draining=True)
    try:
        return make()
    finally:
        router.set_draining(backend="fast-1", draining=False)


def test_a_stored_response_is_retrieved_continued_and_deleted_on_the_backend_that_made_it(
    two_backends: tuple[Cluster, ManualClock],
) -> None:
    cluster, _ = two_backends
    b = cluster.more_fast[0]
    client = _client(cluster)
    made = _on_fast_2(cluster, lambda: client.responses.create(model=MODEL, input="hi"))
    assert made.id == "resp-b1"
    # Without affinity these would go to fast-1, which never heard of it (404).
    assert client.responses.retrieve(made.id).id == made.id
    assert [item.id for item in client.responses.input_items.list(made.id)] == ["in-1"]
    follow = client.responses.create(model=MODEL, input="more", previous_response_id=made.id)
    assert follow.id == "resp-b2"
    assert [(seen.method, seen.path) for seen in b.requests] == [
        ("POST", "/v1/responses"),
        ("GET", f"/v1/responses/{made.id}"),
        ("GET", f"/v1/responses/{made.id}/input_items"),
        ("POST", "/v1/responses"),
    ]
    assert cluster.fast.requests == []
    client.responses.delete(made.id)
    assert made.id not in b.stored
    # Forgotten once deleted, and held nowhere (both answer the search with 404): routed as usual,
    # and fast-1 answers its own 404.
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)
    assert [(seen.method, seen.path) for seen in _not_probes(cluster.fast)] == [("GET", f"/v1/responses/{made.id}")]
    assert [(seen.method, seen.path) for seen in _probes(cluster.fast)] == [("GET", f"/v1/responses/{made.id}")]


def test_a_streamed_response_is_remembered_from_its_created_event(two_backends: tuple[Cluster, ManualClock]) -> None:
    cluster, _ = two_backends
    client = _client(cluster)

    def stream() -> str:
        events = list(client.responses.create(model=MODEL, input="hi", stream=True))
        assert events[0].type == "response.created"
        return events[0].response.id

    made = _on_fast_2(cluster, stream)
    assert made == "resp-b1"
    assert client.responses.retrieve(made).id == made
    assert cluster.fast.requests == []


def test_after_the_affinity_time_the_owner_is_found_again_by_asking(two_backends: tuple[Cluster, ManualClock]) -> None:
    cluster, clock = two_backends
    client = _client(cluster)
    made = _on_fast_2(cluster, lambda: client.responses.create(model=MODEL, input="hi"))
    clock.advance(59)
    assert client.responses.retrieve(made.id).id == made.id
    assert _probes(cluster.fast) == _probes(cluster.more_fast[0]) == []  # remembered: nobody asked
    clock.advance(2)  # 61 s after it was made: forgotten, so the backends are asked who holds it
    assert client.responses.retrieve(made.id).id == made.id
    assert [seen.path for seen in _probes(cluster.fast)] == [f"/v1/responses/{made.id}"]
    assert _not_probes(cluster.fast) == []
    assert cluster.metric("specroute_response_locates_total", result="found") == 1


def test_a_pinned_request_on_a_full_backend_waits_for_it_and_others_flow_past(make_cluster: MakeCluster) -> None:
    # The owner is busy and its pool has another backend free: the request waits for the owner,
    # never sent to the other, while requests that may go anywhere take the other at once.
    # Health checks far apart: their wake-up of the queue must not be what lets the others past.
    # The SDK's key and the plain requests are two clients: with room kept for the first (active
    # for `active_window` after it made the response), the other plain request waited 30 s
    # beside the free slot, and the test passed only once the window was over.
    pools = {"fast": {"backends": {"fast-1": {"max_concurrency": 1}, "fast-2": {"max_concurrency": 1}}}}
    settings = {"pools": pools, "routing": {"mode": "static"}, "health": {"interval": 60.0}}
    with make_cluster(fast_backends=2, fairness={"keep_room": False}, **settings) as cluster:
        cluster.fast.name, cluster.more_fast[0].name = "a", "b"
        client = _client(cluster)
        made = _on_fast_2(cluster, lambda: client.responses.create(model=MODEL, input="hi"))
        gate = threading.Event()
        b = cluster.more_fast[0]
        b.gate = gate
        pool = cluster.app.state.router.pools["fast"]
        completion = {"model": MODEL, "prompt": "x", "max_tokens": 1}
        with ThreadPoolExecutor(2) as executor:

            def hold() -> Any:
                held = executor.submit(httpx.post, cluster.base_url + "/completions", json=completion, timeout=30)
                wait_until(lambda: b.open == 1, message="a request held on fast-2")
                return held

            held = _on_fast_2(cluster, hold)
            pinned = executor.submit(httpx.get, cluster.base_url + f"/responses/{made.id}", timeout=30)
            wait_until(lambda: pool.queued() == 1, message="the pinned request queued for fast-2")
            # Not behind it: fast-1 is free, and another request takes it at once.
            other = httpx.post(cluster.base_url + "/completions", json=completion, timeout=30)
            assert other.status_code == 200 and other.headers["x-route-backend"] == "fast-1"
            assert not pinned.done() and pool.queued() == 1
            gate.set()
            assert held.result().status_code == 200
            answer = pinned.result()
            assert answer.status_code == 200 and answer.json()["id"] == made.id
            assert answer.headers["x-route-backend"] == "fast-2"
            assert answer.headers["x-route-reason"] == "response_affinity"
        assert [seen.path for seen in cluster.fast.requests] == ["/v1/completions"]
        assert pool.queued() == 0


def test_a_pinned_request_whose_backend_stays_full_is_turned_away_like_any_other(make_cluster: MakeCluster) -> None:
    pools = {
        "fast": {
            "queue_timeout": 0.3,
            "queue_size": 1,
            "backends": {"fast-1": {"max_concurrency": 1}, "fast-2": {"max_concurrency": 1}},
        }
    }
    with make_cluster(fast_backends=2, pools=pools, routing={"mode": "static"}) as cluster:
        client = _client(cluster)
        made = _on_fast_2(cluster, lambda: client.responses.create(model=MODEL, input="hi"))
        gate = threading.Event()
        b = cluster.more_fast[0]
        b.gate = gate
        completion = {"model": MODEL, "prompt": "x", "max_tokens": 1}
        with ThreadPoolExecutor(2) as executor:

            def hold() -> Any:
                held = executor.submit(httpx.post, cluster.base_url + "/completions", json=completion, timeout=30)
                wait_until(lambda: b.open == 1, message="a request held on fast-2")
                return held

            held = _on_fast_2(cluster, hold)
            waited = httpx.get(cluster.base_url + f"/responses/{made.id}", timeout=30)
            assert waited.status_code == 503 and waited.json()["error"]["code"] == "queue_timeout"
            assert waited.headers["retry-after"].isdigit()
            # The queue full: turned away at once.
            pool = cluster.app.state.router.pools["fast"]
            first = executor.submit(httpx.get, cluster.base_url + f"/responses/{made.id}", timeout=30)
            wait_until(lambda: pool.queued() == 1, message="one pinned request queued")
            full = httpx.get(cluster.base_url + f"/responses/{made.id}", timeout=30)
            assert full.status_code == 503 and full.json()["error"]["code"] == "queue_full"
            assert first.result().status_code == 503
            gate.set()
            assert held.result().status_code == 200
        assert cluster.fast.requests == []
        assert client.responses.retrieve(made.id).id == made.id


def test_a_queued_pinned_request_is_turned_away_at_once_when_its_backend_is_drained(
    make_cluster: MakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Both backends busy; queued: one request that may go anywhere, then one pinned to fast-2.
    # Draining fast-2 leaves the pinned one nothing to wait for, though the one ahead still waits.
    monkeypatch.setenv("SPECROUTE_TEST_ADMIN_KEY", "admin-secret")
    pools = {
        "fast": {
            "queue_timeout": 20.0,
            "backends": {"fast-1": {"max_concurrency": 1}, "fast-2": {"max_concurrency": 1}},
        }
    }
    # The SDK's key and the plain requests are two clients: no room kept for the first, or the
    # second plain request would wait beside a free slot (router.backends.share).
    settings = {
        "pools": pools,
        "routing": {"mode": "static"},
        "health": {"interval": 60.0},
        "fairness": {"keep_room": False},
    }
    with make_cluster(fast_backends=2, auth={"admin_key_env": "SPECROUTE_TEST_ADMIN_KEY"}, **settings) as cluster:
        client = _client(cluster)
        made = _on_fast_2(cluster, lambda: client.responses.create(model=MODEL, input="hi"))
        gate = threading.Event()
        a, b = cluster.fast, cluster.more_fast[0]
        a.gate = b.gate = gate
        pool = cluster.app.state.router.pools["fast"]
        url, completion = cluster.base_url + "/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1}
        with ThreadPoolExecutor(4) as executor:
            held = [executor.submit(httpx.post, url, json=completion, timeout=30) for _ in range(2)]
            wait_until(lambda: a.open == 1 and b.open == 1, message="a request held on each backend")
            anywhere = executor.submit(httpx.post, url, json=completion, timeout=30)
            wait_until(lambda: pool.queued() == 1, message="a request queued that may go anywhere")
            pinned = executor.submit(httpx.get, cluster.base_url + f"/responses/{made.id}", timeout=30)
            wait_until(lambda: pool.queued() == 2, message="the pinned request queued behind it")
            drained = httpx.post(
                f"{cluster.router.url}/admin/drain",
                json={"backend": "fast-2"},
                headers={"authorization": "Bearer admin-secret"},
                timeout=5,
            )
            assert drained.status_code == 200
            answer = pinned.result(timeout=10)  # not the 20 s queue timeout
            assert answer.status_code == 503 and answer.json()["error"]["code"] == "pool_unavailable"
            assert not anywhere.done() and pool.queued() == 1
            gate.set()
            assert [each.result().status_code for each in held] == [200, 200]
            assert anywhere.result().status_code == 200
        assert pool.queued() == 0


# -- Retry-After from what the pool measured ------------------------------------------------------


def test_retry_after_is_1_s_before_anything_is_measured_then_follows_the_measured_durations(
    make_cluster: MakeCluster,
) -> None:
    clock = ManualClock()
    pools = {"fast": {"queue_size": 0, "backends": {"fast-1": {"max_concurrency": 1}}}}
    with make_cluster(pools=pools, routing={"mode": "static"}, live_clock=clock) as cluster:
        url = cluster.base_url + "/completions"
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
        pinned = {"x-route-pool": "fast"}

        def held_for(seconds: float) -> httpx.Response:
            """A second request turned away while one is held for `seconds` of the router's clock."""
            gate = threading.Event()
            cluster.fast.gate = gate
            with ThreadPoolExecutor(1) as executor:
                first = executor.submit(httpx.post, url, json=body, headers=pinned, timeout=30)
                wait_until(lambda: cluster.fast.open == 1, message="a request held")
                turned_away = httpx.post(url, json=body, headers=pinned, timeout=30)
                clock.advance(seconds)
                gate.set()
                assert first.result().status_code == 200
            return turned_away

        cold = held_for(30)
        assert cold.status_code == 503 and cold.json()["error"]["code"] == "queue_full"
        assert cold.headers["retry-after"] == "1"  # nothing measured yet
        # One request took 30 s of the pool's one slot: the next is likely in 30 s.
        assert held_for(1000).headers["retry-after"] == "30"
        # The running mean moved toward 1000 s: capped at 60.
        assert held_for(1).headers["retry-after"] == "60"


# -- the Retry-After of a pool with no backend --------------------------------------------------


def test_a_pool_with_no_backend_answers_retry_after_from_its_measure(make_cluster: MakeCluster) -> None:
    with make_cluster(routing={"mode": "static"}) as cluster:
        router = cluster.app.state.router
        router.set_draining(pool="fast", draining=True)
        answer = httpx.post(
            cluster.base_url + "/completions",
            json={"model": MODEL, "prompt": "x"},
            headers={"x-route-pool": "fast"},
            timeout=30,
        )
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "pool_unavailable"
        assert answer.headers["retry-after"] == "1"
