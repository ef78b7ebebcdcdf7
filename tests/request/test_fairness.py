"""Who a client is on an open router, and the fair order of a contended pool, seen through the router."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import openai
import pytest

from router.clock import ManualClock
from tests.conftest import Cluster
from tests.wait import until

pytestmark = pytest.mark.e2e  # the router served on loopback in front of fake engines

BODY = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}


def _queued(cluster: Cluster) -> float:
    return cluster.metric("specroute_queued_requests", pool="fast", job_class="interactive")


async def _ask(client: openai.AsyncOpenAI, text: str) -> None:
    await client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": text}], max_tokens=2)


async def _streams(base_url: str, clients: list[tuple[str, int]]) -> dict[str, list[str]]:
    """Streams at the same moment, `count` for each key; the job classes each key's requests got."""

    async def one(client: openai.AsyncOpenAI) -> str:
        raw = await client.chat.completions.with_raw_response.create(
            model="test-model", messages=[{"role": "user", "content": "hi"}], max_tokens=20, stream=True
        )
        async for _ in raw.parse():
            pass
        return str(raw.headers["x-job-type"])

    made = {key: openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0) for key, _ in clients}
    try:
        jobs = await asyncio.gather(*(asyncio.gather(*(one(made[key]) for _ in range(n))) for key, n in clients))
        return {key: list(got) for (key, _), got in zip(clients, jobs, strict=True)}
    finally:
        for client in made.values():
            await client.close()


def test_distinct_keys_from_one_address_are_distinct_clients_on_an_open_router(
    make_cluster: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # No client keys configured; a batch job and two developers on one host, each with its key.
    with (
        caplog.at_level(logging.INFO, logger="specroute.access"),
        make_cluster(pools={"fast": {"backends": {"fast-1": {"max_concurrency": 64}}}}) as cluster,
    ):
        cluster.fast.token_delay = cluster.team.token_delay = 0.02
        jobs = asyncio.run(
            _streams(cluster.base_url, [("sk-etl-7f3e21", 12), ("sk-dev-alice-91", 1), ("sk-dev-bob-44", 1)])
        )
        assert jobs["sk-dev-alice-91"] == ["interactive"]
        assert jobs["sk-dev-bob-44"] == ["interactive"]
        assert jobs["sk-etl-7f3e21"].count("batch") >= 8, jobs
        status = httpx.get(cluster.router.url + "/router/status").text
        metrics = httpx.get(cluster.router.url + "/metrics").text
    logged = "\n".join(record.getMessage() for record in caplog.records)
    for key in ("sk-etl-7f3e21", "sk-dev-alice-91", "sk-dev-bob-44"):
        assert key not in logged and key not in status and key not in metrics


def test_users_sharing_a_placeholder_key_are_one_client(make_cluster: Any) -> None:
    with make_cluster(pools={"fast": {"backends": {"fast-1": {"max_concurrency": 64}}}}) as cluster:
        cluster.fast.token_delay = cluster.team.token_delay = 0.02
        jobs = asyncio.run(_streams(cluster.base_url, [("EMPTY", 12)]))
        # Twelve at once from one address with a key that names nobody: one batch job.
        assert jobs["EMPTY"].count("batch") >= 8, jobs


def test_a_request_through_a_proxy_not_trusted_is_warned_of_once(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    # The router trusts 127.0.0.1 by default: a header naming another client is taken, no warning.
    with caplog.at_level(logging.WARNING, logger="specroute"):
        for _ in range(3):
            response = httpx.post(
                cluster.base_url + "/chat/completions", json=BODY, headers={"x-forwarded-for": "203.0.113.7"}
            )
            assert response.status_code == 200
    assert not [r for r in caplog.records if "forwarded_allow_ips" in r.getMessage()]


def test_a_proxy_not_trusted_is_named_in_the_log(make_cluster: Any, caplog: pytest.LogCaptureFixture) -> None:
    with (
        caplog.at_level(logging.WARNING, logger="specroute"),
        make_cluster(listen={"forwarded_allow_ips": ["10.9.9.9"]}) as cluster,
    ):
        for _ in range(3):
            response = httpx.post(
                cluster.base_url + "/chat/completions", json=BODY, headers={"x-forwarded-for": "203.0.113.7"}
            )
            assert response.status_code == 200
    warnings = [r.getMessage() for r in caplog.records if "forwarded_allow_ips" in r.getMessage()]
    assert len(warnings) == 1 and "127.0.0.1" in warnings[0]


@pytest.mark.parametrize("fair_share", [True, False])
def test_a_contended_pool_admits_a_light_client_before_a_heavy_ones_queue(make_cluster: Any, fair_share: bool) -> None:
    settings = {
        "pools": {"fast": {"queue_size": 32, "backends": {"fast-1": {"max_concurrency": 2}}}},
        "routing": {"mode": "static"},
        "classify": {"batch_inflight_threshold": 64, "burst_hold_seconds": 0},
        "fairness": {"fair_share": fair_share},
    }
    with make_cluster(**settings) as cluster:
        cluster.fast.first_token_delay = 0.2

        async def run() -> None:
            agent = openai.AsyncOpenAI(base_url=cluster.base_url, api_key="sk-agent-1", max_retries=0)
            user = openai.AsyncOpenAI(base_url=cluster.base_url, api_key="sk-user-1", max_retries=0)

            try:
                agents = [asyncio.create_task(_ask(agent, f"agent {n}")) for n in range(10)]
                await until(lambda: _queued(cluster) == 8, message="the agent's eight queued")
                await _ask(user, "user")
                await asyncio.gather(*agents)
            finally:
                await agent.close()
                await user.close()

        asyncio.run(run())
        order = [seen.body["messages"][0]["content"] for seen in cluster.fast.requests if seen.body]
        if fair_share:
            assert order.index("user") == 2, order  # the first slot freed
        else:
            assert order.index("user") == 10, order  # behind the agent's whole queue


def test_a_heavy_client_leaves_room_for_an_active_light_one(make_cluster: Any) -> None:
    settings = {
        "pools": {"fast": {"queue_size": 32, "backends": {"fast-1": {"max_concurrency": 4}}}},
        "routing": {"mode": "static"},
        "classify": {"batch_inflight_threshold": 64, "burst_hold_seconds": 0},
    }
    with make_cluster(**settings) as cluster:

        async def run() -> dict[str, Any]:
            agent = openai.AsyncOpenAI(base_url=cluster.base_url, api_key="sk-agent-1", max_retries=0)
            user = openai.AsyncOpenAI(base_url=cluster.base_url, api_key="sk-user-1", max_retries=0)

            try:
                await _ask(user, "user 1")  # the user is active, and holds nothing
                cluster.fast.first_token_delay = 1.0
                agents = [asyncio.create_task(_ask(agent, f"agent {n}")) for n in range(10)]
                # Four slots: the agent takes three and waits for the rest with one slot free.
                await until(lambda: _queued(cluster) == 7, message="seven of the agent's held back")
                assert cluster.metric("specroute_in_flight_requests", pool="fast", backend="fast-1") == 3
                await _ask(user, "user 2")
                async with httpx.AsyncClient() as http:
                    view = (await http.get(cluster.router.url + "/router/status")).json()
                await asyncio.gather(*agents)
                return dict(view["pools"]["fast"]["clients"])
            finally:
                await agent.close()
                await user.close()

        clients = asyncio.run(run())
        order = [seen.body["messages"][0]["content"] for seen in cluster.fast.requests if seen.body]
        assert order.index("user 2") == 4, order  # after the agent's first three, before its fourth
        assert clients["keep_room"] is True and clients["active_clients"] == 2
        assert clients["held_back"] == 7
        assert cluster.metric("specroute_held_back_requests_total", pool="fast") == 7


def test_status_and_metrics_show_the_top_clients_of_a_contended_pool(make_cluster: Any) -> None:
    settings = {
        "pools": {"fast": {"queue_size": 32, "backends": {"fast-1": {"max_concurrency": 4}}}},
        "routing": {"mode": "static"},
        "classify": {"batch_inflight_threshold": 64, "burst_hold_seconds": 0},
        "fairness": {"top_clients": 1},
    }
    with make_cluster(**settings) as cluster:
        cluster.fast.first_token_delay = 1.0

        async def run() -> dict[str, Any]:
            async with httpx.AsyncClient(timeout=30) as client:

                async def ask(key: str) -> None:
                    url = cluster.base_url + "/chat/completions"
                    await client.post(url, json=BODY, headers={"authorization": f"Bearer {key}"})

                asks = [asyncio.create_task(ask("sk-user-1"))]
                await until(lambda: cluster.metric("specroute_in_flight_requests", pool="fast", backend="fast-1") == 1)
                asks += [asyncio.create_task(ask("sk-agent-1")) for _ in range(5)]
                await until(lambda: _queued(cluster) == 2, message="two of the agent's queued")
                view = (await client.get(cluster.router.url + "/router/status")).json()
                shown = dict(view["pools"]["fast"]["clients"])
                metrics = (await client.get(cluster.router.url + "/metrics")).text
                await asyncio.gather(*asks)
                return {**shown, "metrics": metrics}

        clients = asyncio.run(run())
        assert clients["fair_share"] is True
        [top] = clients["top"]
        assert top["client"].startswith("key:") and "sk-agent" not in top["client"]
        assert top["slots"] == 3  # the agent's; the user holds the fourth
        assert clients["others"] == {"clients": 1, "slots": 1}
        # The same in /metrics: one series by name, the rest as `others`, never one per client.
        series = [line for line in clients["metrics"].splitlines() if line.startswith("specroute_client_slots{")]
        assert len(series) == 2, series
        assert f'client="{top["client"]}",pool="fast"}} {top["slots"]}.0' in "\n".join(series)
        assert cluster.metric("specroute_client_slots", pool="fast", client="others") == 0  # all served: none left


def test_over_a_limit_is_429_with_openais_headers_and_the_sdk_retries(
    make_cluster: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECROUTE_TEST_TEAM_KEYS", "sk-team-a,sk-team-b")
    limits = {"groups": {"team": {"keys_env": "SPECROUTE_TEST_TEAM_KEYS", "requests_per_minute": 60}}}
    clock = ManualClock()  # the minute moves only when the test moves it
    with make_cluster(fairness=limits, live_clock=clock) as cluster:
        messages: Any = [{"role": "user", "content": "hi"}]
        with cluster.client("sk-team-a") as plain:
            first = plain.chat.completions.with_raw_response.create(model="test-model", messages=messages)
            assert first.headers["x-ratelimit-limit-requests"] == "60"
            assert first.headers["x-ratelimit-remaining-requests"] == "59"
            assert first.headers["x-ratelimit-reset-requests"] == "1s"
            for _ in range(59):
                plain.chat.completions.create(model="test-model", messages=messages, max_tokens=1)
            with pytest.raises(openai.RateLimitError) as refused:
                plain.chat.completions.create(model="test-model", messages=messages)
        error = refused.value
        assert error.code == "rate_limit_exceeded" and error.type == "requests"
        assert error.response.headers["x-ratelimit-remaining-requests"] == "0"
        assert error.response.headers["retry-after"] == "1"
        assert error.response.headers["retry-after-ms"] == "1000"
        assert error.response.headers["x-ratelimit-reset-requests"] == "1m0s"
        seen = len(cluster.fast.requests) + len(cluster.team.requests)
        assert seen == 60  # the refused one was not forwarded
        # Another key of the group has its own minute.
        with openai.OpenAI(base_url=cluster.base_url, api_key="sk-team-b") as other:
            other.chat.completions.create(model="test-model", messages=messages, max_tokens=1)

        # The SDK with its retries waits as told (retry-after-ms, 1 s) and gets through: the
        # router's minute moves on by that second when the 429 reaches the client.
        def on_response(response: Any) -> None:  # the SDK's own httpx (httpx2)
            if response.status_code == 429:
                clock.advance(float(response.headers["retry-after-ms"]) / 1000)

        http = openai.DefaultHttpxClient(event_hooks={"response": [on_response]})
        with openai.OpenAI(base_url=cluster.base_url, api_key="sk-team-a", max_retries=2, http_client=http) as retrying:
            answer = retrying.chat.completions.with_raw_response.create(model="test-model", messages=messages)
        assert answer.retries_taken == 1
        assert answer.parse().choices
        refused_count = sum(
            sample.value
            for family in cluster.registry.collect()
            for sample in family.samples
            if sample.name == "specroute_requests_total" and sample.labels.get("code") == "rate_limit_exceeded"
        )
        assert refused_count == 2  # the one refused above, and the one the SDK retried


def test_a_pool_that_schedules_by_priority_gets_each_requests_priority(make_cluster: Any) -> None:
    pools = {"team": {"priority_scheduling": True}}
    with make_cluster(pools=pools, classify={"burst_hold_seconds": 0}) as cluster:
        url = cluster.base_url + "/chat/completions"
        for headers in (
            {"x-route-pool": "team"},  # interactive, pinned
            {"x-job-type": "batch"},
            {"x-route-pool": "fast"},  # a pool that does not: nothing added
        ):
            body = {**BODY, "priority": -1000}  # a client's own is not the engine's order
            assert httpx.post(url, json=body, headers=headers).status_code == 200
        assert [seen.body.get("priority") for seen in cluster.team.requests if seen.body] == [0, 100]
        assert [seen.body.get("priority") for seen in cluster.fast.requests if seen.body] == [-1000]
