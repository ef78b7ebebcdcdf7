"""The router's promises under faults, each tested against a fake engine that misbehaves on purpose."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from router.clock import ManualClock
from tests.conftest import Cluster
from tests.wait import wait_until

pytestmark = pytest.mark.e2e  # the router served on loopback in front of fake engines

CHAT = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@contextmanager
def dead_url() -> Iterator[str]:
    with socket.socket() as placeholder:
        placeholder.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        yield f"http://127.0.0.1:{placeholder.getsockname()[1]}"


def _post(cluster: Cluster, **extra: Any) -> httpx.Response:
    return httpx.post(cluster.base_url + "/chat/completions", json={**CHAT, **extra}, timeout=10)


def _events(response: httpx.Response) -> list[str]:
    return [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]


def test_refused_connection_is_retried_on_the_other_pool_before_the_first_byte(make_cluster: Any) -> None:
    with dead_url() as dead, make_cluster(pools={"fast": {"backends": {"fast-1": {"url": dead}}}}) as cluster:
        cluster.app.state.router.pools["fast"].backends[0].outlier.healthy = True  # as if the engine just died
        response = _post(cluster, stream=True)
        assert response.status_code == 200
        assert response.headers["x-route-pool"] == "team"
        assert response.headers["x-route-reason"] == "failover:fast"
        assert _events(response)[-1] == "[DONE]"
        assert (
            cluster.settled_metric("specroute_retries_total", 1, pool="fast", backend="fast-1", reason="connect") == 1
        )


def test_503_is_retried_on_another_backend_of_the_same_pool(make_cluster: Any) -> None:
    with make_cluster(fast_backends=2, routing={"mode": "static"}) as cluster:
        cluster.fast.fail_status = cluster.more_fast[0].fail_status = 503
        cluster.more_fast[0].fail_count = 0  # fast-2 serves
        cluster.fast.fail_count = 1
        response = _post(cluster)
        assert response.status_code == 200
        assert response.headers["x-route-pool"] == "fast"
        assert response.headers["x-route-backend"] == "fast-2"
        assert (len(cluster.fast.requests), len(cluster.more_fast[0].requests)) == (1, 1)
        assert cluster.team.requests == []
        assert (
            cluster.settled_metric("specroute_retries_total", 1, pool="fast", backend="fast-1", reason="http_503") == 1
        )


def test_upstream_4xx_is_never_retried(cluster: Cluster) -> None:
    response = _post(cluster, model="missing")
    assert response.status_code == 404
    assert len(cluster.fast.requests) + len(cluster.team.requests) == 1


def test_when_every_place_fails_the_last_upstream_answer_is_passed_on(cluster: Cluster) -> None:
    cluster.fast.fail_status = cluster.team.fail_status = 503
    response = _post(cluster)
    assert response.status_code == 503
    assert response.json()["error"]["message"] == "overloaded"  # the engine's own body, unchanged
    assert (len(cluster.fast.requests), len(cluster.team.requests)) == (1, 1)  # each place once


def test_when_the_deadline_ends_the_retries_the_engines_own_answer_is_passed_on(make_cluster: Any) -> None:
    """`retries.deadline`, not `attempts`, ends the loop: the client gets the engine's 503 and
    body, as when the attempts run out, not the router's 502 saying it answered 503."""
    with make_cluster(retries={"attempts": 3, "deadline": 0.05}) as cluster:
        cluster.fast.fail_status = cluster.team.fail_status = 503
        cluster.fast.fail_delay = 0.2  # the deadline has passed when the first answer comes
        response = _post(cluster)
        assert response.status_code == 503
        assert response.json()["error"]["message"] == "overloaded"  # the engine's own body, unchanged
        assert response.headers["x-route-backend"] == "fast-1"
        assert (len(cluster.fast.requests), len(cluster.team.requests)) == (1, 0)  # no new attempt
        assert cluster.metric("specroute_retries_total", pool="fast", backend="fast-1", reason="http_503") == 0


def test_retry_budget_caps_retries(make_cluster: Any) -> None:
    with make_cluster(retries={"budget": 0, "min_concurrent": 0}) as cluster:
        cluster.fast.fail_status = 503
        response = _post(cluster)
        assert response.status_code == 503
        assert cluster.team.requests == []


def test_no_retry_after_the_first_byte_and_one_error_event_when_the_engine_dies(cluster: Cluster) -> None:
    cluster.fast.die_after = 2
    response = _post(cluster, stream=True)
    events = _events(response)
    assert response.status_code == 200
    contents = [json.loads(e)["choices"][0]["delta"].get("content") for e in events[:-1]]
    assert [c for c in contents if c] == ["w0 ", "w1 "]  # what came before, nothing twice
    assert json.loads(events[-1])["error"]["code"] == "upstream_failed"
    assert "[DONE]" not in events
    assert cluster.team.requests == []  # not retried: the client had bytes already


def test_stalled_stream_ends_with_one_error_event_at_the_idle_timeout(make_cluster: Any) -> None:
    with make_cluster(timeouts={"idle": 0.3}) as cluster:
        cluster.fast.stall_after = 2
        started = time.monotonic()
        response = _post(cluster, stream=True)
        assert time.monotonic() - started < 10  # at the idle timeout, not the read timeout
        events = _events(response)
        assert json.loads(events[-1])["error"]["code"] == "upstream_timeout"
        assert "[DONE]" not in events
        assert cluster.fast.wait_idle()  # the stalled upstream request was closed


def test_failing_backend_is_ejected_for_growing_times_and_readmitted(make_cluster: Any) -> None:
    # The router's live clock is the test's: ejection times pass when the test says so.
    clock = ManualClock()
    health = {"interval": 0.05, "eject_after": 2, "ejection_seconds": 10.0, "healthy_after": 1}
    with make_cluster(health=health, routing={"mode": "static"}, live_clock=clock) as cluster:
        backend = cluster.app.state.router.pools["fast"].backends[0]
        outlier = backend.outlier
        cluster.fast.fail_status = 503
        for _ in range(2):
            assert _post(cluster).headers["x-route-pool"] == "team"  # failed over each time
        assert backend.healthy is False and outlier.ejections == 1
        assert outlier.ejected_for == 10.0
        assert outlier.ejected_left(clock.now()) == 10.0
        # While ejected, nothing is sent there even though /health answers 200.
        probes = cluster.fast.health_checks
        wait_until(lambda: cluster.fast.health_checks >= probes + 3, message="probes while ejected")
        assert backend.healthy is False
        seen = len(cluster.fast.requests)
        _post(cluster)
        assert len(cluster.fast.requests) == seen
        # After its time the health checker readmits it; it fails twice more: twice as long out.
        clock.advance(10.0)
        wait_until(lambda: backend.healthy, message="readmitted after its ejection")
        for _ in range(2):
            _post(cluster)
        assert outlier.ejections == 2
        assert outlier.ejected_for == 20.0  # twice as long: it failed again before any success
        # Once it works again it comes back and stays.
        cluster.fast.fail_status = None
        clock.advance(20.0)
        wait_until(lambda: backend.healthy, message="readmitted once it works")
        assert _post(cluster).headers["x-route-pool"] == "fast"
        assert outlier.ejections == 0


def test_active_checks_take_a_backend_out_and_back_by_thresholds(make_cluster: Any) -> None:
    health = {"interval": 0.05, "unhealthy_after": 3, "healthy_after": 2}
    with make_cluster(health=health) as cluster:
        backend = cluster.app.state.router.pools["team"].backends[0]
        cluster.team.healthy = False
        wait_until(lambda: not backend.healthy, message="taken out by failed checks")
        assert httpx.get(cluster.router.url + "/readyz").json()["backends"]["team-1"] is False
        cluster.team.healthy = True
        wait_until(lambda: backend.healthy, message="back after passed checks")


def test_a_pool_with_no_healthy_backend_answers_503_within_100_ms(make_cluster: Any) -> None:
    with (
        dead_url() as dead,
        make_cluster(pools={"team": {"backends": {"team-1": {"url": dead}}}}, routing={"mode": "static"}) as cluster,
        httpx.Client() as client,
    ):
        times = []
        for _ in range(5):
            started = time.perf_counter()
            response = client.post(cluster.base_url + "/chat/completions", json=CHAT, headers={"X-Job-Type": "batch"})
            times.append(time.perf_counter() - started)
            assert response.status_code == 503
            assert response.headers["retry-after"]
        assert min(times) < 0.1
