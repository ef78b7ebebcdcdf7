"""The router in front of two fake engines, driven by the official OpenAI client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import Cluster
from tests.wait import wait_until

pytestmark = pytest.mark.e2e  # the router served on loopback in front of fake engines


def _access_lines(caplog: pytest.LogCaptureFixture, count: int = 1) -> list[str]:
    """The access-log lines, once `count` are there: the router logs just after the last byte."""

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "specroute.access"]

    with contextlib.suppress(AssertionError):
        wait_until(lambda: len(lines()) >= count, message=f"{count} access-log lines")
    return lines()


def _client(cluster: Cluster, **kwargs: Any) -> openai.OpenAI:
    return cluster.client("client-key", **kwargs)


def test_chat_stream_passes_through_with_route_headers(cluster: Cluster) -> None:
    raw = _client(cluster).chat.completions.with_raw_response.create(
        model="test-model", messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True
    )
    chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "w0 w1 w2 w3 w4 "
    # The usage chunk the router asked for on the client's behalf does not reach the client.
    assert all(c.usage is None for c in chunks)
    assert raw.headers["x-route-pool"] == "fast"
    assert raw.headers["x-route-backend"] == "fast-1"
    assert raw.headers["x-job-type"] == "interactive"
    assert raw.headers["x-route-reason"] == "default"
    assert raw.headers["content-type"].startswith("text/event-stream")
    forwarded = cluster.fast.requests[-1].body
    assert forwarded["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}
    labels = {"pool": "fast", "backend": "fast-1", "job_class": "interactive", "model": "test-model"}
    assert (
        cluster.settled_metric(
            "specroute_completion_tokens_total", 5, pool="fast", backend="fast-1", model="test-model"
        )
        == 5
    )
    assert cluster.settled_metric("specroute_time_to_first_token_seconds_count", 1, **labels) == 1
    assert cluster.settled_metric("specroute_time_per_output_token_seconds_count", 1, **labels) == 1
    assert cluster.settled_metric("specroute_request_duration_seconds_count", 1, **labels) == 1
    assert cluster.metric("specroute_requests_total", **labels, status="200", code="") == 1


def test_continuous_usage_without_include_usage_gives_no_usage_as_from_the_engine(cluster: Cluster) -> None:
    """vLLM sends usage on every chunk only with `include_usage`: asked for `continuous_usage_stats`
    alone it sends none, so the usage the router asks for must not ride on every chunk either."""
    stream = _client(cluster).chat.completions.create(
        model="test-model",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        stream=True,
        extra_body={"stream_options": {"continuous_usage_stats": True}},  # vLLM's own option
    )
    assert all(c.usage is None for c in stream)
    forwarded = cluster.fast.requests[-1].body
    assert forwarded["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}


def test_usage_chunk_reaches_client_that_asked_for_it(cluster: Cluster) -> None:
    stream = _client(cluster).chat.completions.create(
        model="test-model",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    usages = [c.usage for c in stream if c.usage is not None]
    assert len(usages) == 1
    assert usages[0].completion_tokens == 3


def test_completions_stream_and_whole(cluster: Cluster) -> None:
    client = _client(cluster)
    stream = client.completions.create(model="test-model", prompt="once", max_tokens=4, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == "w0 w1 w2 w3 "
    whole = client.completions.create(model="test-model", prompt="once", max_tokens=2)
    assert whole.choices[0].text == "w0 w1"
    assert whole.usage is not None
    assert whole.usage.completion_tokens == 2
    assert (
        cluster.settled_metric(
            "specroute_completion_tokens_total", 6, pool="fast", backend="fast-1", model="test-model"
        )
        == 6
    )


def test_non_streaming_chat_keeps_status_body_and_type(cluster: Cluster) -> None:
    response = httpx.post(
        cluster.base_url + "/chat/completions",
        json={"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.json()["choices"][0]["message"]["content"] == "w0 w1"
    assert "stream_options" not in cluster.fast.requests[-1].body


@pytest.mark.anyio
async def test_async_client_streams_chat(cluster: Cluster) -> None:
    client = openai.AsyncOpenAI(base_url=cluster.base_url, api_key="k", max_retries=0)
    stream = await client.chat.completions.create(
        model="test-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
    )
    pieces = [c.choices[0].delta.content async for c in stream if c.choices and c.choices[0].delta.content]
    assert pieces == ["w0 ", "w1 ", "w2 "]
    whole = await client.chat.completions.create(
        model="test-model", messages=[{"role": "user", "content": "hi"}], max_tokens=1
    )
    assert whole.choices[0].message.content == "w0"
    await client.close()


def test_embeddings_and_other_v1_paths_are_forwarded(cluster: Cluster) -> None:
    client = _client(cluster)
    embedding = client.embeddings.create(model="test-model", input="hello")
    assert embedding.data[0].embedding == [0.1, 0.2, 0.3]
    response = httpx.post(cluster.base_url + "/responses", json={"model": "test-model", "input": "hi"})
    assert response.status_code == 200
    assert response.json()["id"] == "resp-1"
    assert [seen.path for seen in cluster.fast.requests] == ["/v1/embeddings", "/v1/responses"]


def test_job_header_sends_batch_to_standard_pool_and_is_not_forwarded(cluster: Cluster) -> None:
    raw = _client(cluster, default_headers={"X-Job-Type": "batch"}).chat.completions.with_raw_response.create(
        model="test-model", messages=[{"role": "user", "content": "hi"}], max_tokens=1
    )
    assert raw.headers["x-route-pool"] == "team"
    assert raw.headers["x-job-type"] == "batch"
    assert raw.headers["x-route-reason"] == "header"
    seen = cluster.team.requests[-1].headers
    assert "x-job-type" not in seen
    assert cluster.fast.requests == []


def test_pool_header_pins_a_pool(cluster: Cluster) -> None:
    raw = _client(cluster, default_headers={"X-Route-Pool": "team"}).chat.completions.with_raw_response.create(
        model="test-model", messages=[{"role": "user", "content": "hi"}], max_tokens=1
    )
    assert raw.headers["x-route-pool"] == "team"
    assert raw.headers["x-route-reason"] == "pinned"
    assert raw.headers["x-job-type"] == "interactive"
    assert "x-route-pool" not in cluster.team.requests[-1].headers


def test_request_id_travels_and_client_key_stays(cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    secret_prompt = "my secret prompt"
    with caplog.at_level(logging.INFO, logger="specroute.access"):
        raw = _client(cluster, default_headers={"X-Request-Id": "req-42"}).chat.completions.with_raw_response.create(
            model="test-model", messages=[{"role": "user", "content": secret_prompt}], max_tokens=2
        )
        lines = _access_lines(caplog)
    assert raw.headers["x-request-id"] == "req-42"
    seen = cluster.fast.requests[-1].headers
    assert seen["x-request-id"] == "req-42"
    assert "authorization" not in seen
    assert len(lines) == 1
    assert "id=req-42" in lines[0]
    assert "pool=fast" in lines[0]
    assert "status=200" in lines[0]
    assert "tokens=2" in lines[0]
    assert secret_prompt not in lines[0]
    assert "client-key" not in lines[0]


def test_new_request_id_when_client_sends_none(cluster: Cluster) -> None:
    response = httpx.post(cluster.base_url + "/completions", json={"model": "test-model", "prompt": "x"})
    generated = response.headers["x-request-id"]
    assert len(generated) == 32
    assert cluster.fast.requests[-1].headers["x-request-id"] == generated


def test_upstream_4xx_reaches_client_unchanged(cluster: Cluster) -> None:
    response = httpx.post(cluster.base_url + "/chat/completions", json={"model": "nope", "messages": []})
    assert response.status_code == 404
    assert response.json() == {
        "error": {"message": "The model `nope` does not exist.", "type": "NotFoundError", "param": None, "code": 404}
    }
    with pytest.raises(openai.NotFoundError):
        _client(cluster).chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_models_is_the_deduplicated_union(make_cluster: Any) -> None:
    with make_cluster() as cluster:
        cluster.team.model = "other-model"
        ids = sorted(m.id for m in _client(cluster).models.list())
        assert ids == ["other-model", "test-model"]
    with make_cluster() as cluster:
        assert [m.id for m in _client(cluster).models.list()] == ["test-model"]


@pytest.mark.parametrize("answer", [{"data": 5}, {"data": "x"}, {"data": [5, {"id": 3}, None]}, [1, 2], 7])
def test_models_ignores_a_malformed_engine_answer(make_cluster: Any, answer: Any) -> None:
    with make_cluster() as cluster:
        cluster.team.models_answer = answer
        response = httpx.get(cluster.base_url + "/models", headers={"authorization": "Bearer client-key"})
        assert response.status_code == 200
        assert [m["id"] for m in response.json()["data"]] == ["test-model"]  # the other engine's


def test_health_endpoints(cluster: Cluster) -> None:
    assert httpx.get(cluster.router.url + "/healthz").json() == {"status": "ok"}
    ready = httpx.get(cluster.router.url + "/readyz")
    assert ready.status_code == 200
    assert ready.json() == {
        "ready": True,
        "backends": {"fast-1": True, "team-1": True},
        "shutting_down": False,
        "shared_state": {"store": "none", "sharing": False},  # alone: no state.redis_url
    }


def test_rule_on_api_key_makes_batch_and_rewrites_model(make_cluster: Any) -> None:
    rules = [
        {
            "name": "etl",
            "job": "batch",
            "match": {"api_key": "etl-key", "model": "*-batch"},
            "rewrite_model": "test-model",
        }
    ]
    with make_cluster(classify={"rules": rules}) as cluster:
        client = cluster.client("etl-key")
        raw = client.completions.with_raw_response.create(model="test-batch", prompt="x", max_tokens=1)
        assert raw.headers["x-route-pool"] == "team"
        assert raw.headers["x-route-reason"] == "rule:etl"
        assert cluster.team.requests[-1].body["model"] == "test-model"
        # The same model name with another key is not the ETL job.
        other = _client(cluster).completions.with_raw_response.create(model="test-model", prompt="x", max_tokens=1)
        assert other.headers["x-route-pool"] == "fast"


def test_n_greater_than_one_is_batch(cluster: Cluster) -> None:
    response = httpx.post(cluster.base_url + "/completions", json={"model": "test-model", "prompt": "x", "n": 2})
    assert response.headers["x-route-pool"] == "team"
    assert response.headers["x-route-reason"] == "n>1"


def test_decisions_are_counted(cluster: Cluster) -> None:
    client = _client(cluster)
    client.completions.create(model="test-model", prompt="x", max_tokens=1)
    client.completions.create(model="test-model", prompt="x", max_tokens=1, n=2)
    assert (
        cluster.settled_metric(
            "specroute_route_decisions_total",
            1,
            job_class="interactive",
            pool="fast",
            reason="default",
            content="prose",
        )
        == 1
    )
    assert (
        cluster.settled_metric(
            "specroute_route_decisions_total", 1, job_class="batch", pool="team", reason="n>1", content="prose"
        )
        == 1
    )


def test_access_log_escapes_control_characters(cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="specroute.access"):
        httpx.post(
            cluster.base_url + "/completions",
            json={"model": "test-model", "prompt": "x"},
            headers={"X-Request-Id": "evil\tid=forged"},
        )
        [line] = _access_lines(caplog)
    assert "\t" not in line
    assert json.dumps("evil\tid=forged") in line


async def _streams_at_once(base_url: str, key: str, users: list[str | None]) -> list[str]:
    """One stream per entry at the same moment (a `user` each, or none); the job class of each."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0)

    async def one(user: str | None) -> str:
        raw = await client.chat.completions.with_raw_response.create(
            model="test-model",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=20,
            stream=True,
            extra_body={"user": user} if user is not None else None,
        )
        async for _ in raw.parse():
            pass
        return str(raw.headers["x-job-type"])

    try:
        return await asyncio.gather(*(one(user) for user in users))
    finally:
        await client.close()


@pytest.mark.parametrize("configured", [False, True])
def test_users_sharing_one_key_are_told_apart_by_user(
    make_cluster: Any, monkeypatch: pytest.MonkeyPatch, configured: bool
) -> None:
    # The README's `api_key="none"` with no client keys configured, or one key a whole team shares.
    auth = {}
    if configured:
        monkeypatch.setenv("SPECROUTE_TEST_CLIENT_KEYS", "team-key")
        auth = {"auth": {"client_keys_env": "SPECROUTE_TEST_CLIENT_KEYS"}}
    key = "team-key" if configured else "none"
    with make_cluster(pools={"fast": {"backends": {"fast-1": {"max_concurrency": 64}}}}, **auth) as cluster:
        cluster.fast.token_delay = 0.02  # long enough for all 16 to be in flight together
        jobs = asyncio.run(_streams_at_once(cluster.base_url, key, [f"user-{n}" for n in range(16)]))
        assert jobs == ["interactive"] * 16
        # One job with 16 requests in flight under the same key and no `user` is a batch job.
        jobs = asyncio.run(_streams_at_once(cluster.base_url, key, [None] * 16))
        assert jobs.count("batch") >= 12, jobs


def test_only_a_users_first_request_waits_the_burst_hold(make_cluster: Any) -> None:
    """A user sending one request at a time is held once, as a client not seen lately; its next
    requests are answered at once (each of them waited the whole hold before its first token)."""
    hold = 5.0
    body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with (
        make_cluster(classify={"burst_hold_seconds": hold}) as cluster,
        httpx.Client(base_url=cluster.base_url, timeout=60) as client,
    ):
        assert client.post("/chat/completions", json=body).status_code == 200  # held: new
        for _ in range(2):
            # Within less than the hold: a request that waited it times out.
            response = client.post("/chat/completions", json=body, timeout=hold * 0.8)
            assert response.status_code == 200
