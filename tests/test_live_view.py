"""The live view is live: first tokens recorded as they arrive, the oldest stream still waiting
for one, the last acceptance kept with its age, backend state changes in the log."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest

from router.backends.engines import EngineLoad, EngineView
from router.backends.pools import Pools
from router.clock import ManualClock
from router.config import Settings
from router.routing.learn import SpeedModel
from router.routing.snapshot import snapshot
from tests.conftest import Cluster
from tests.wait import wait_until

TTFT = "specroute_time_to_first_token_seconds_count"
OLDEST = "specroute_oldest_waiting_first_token_seconds"


def _summed(cluster: Cluster, name: str, **labels: str) -> float:
    """A metric summed over the labels not given (job class, model)."""
    return sum(
        sample.value
        for family in cluster.registry.collect()
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


def _stream_body(**extra: Any) -> dict[str, Any]:
    return {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "stream": True, **extra}


@pytest.mark.e2e
def test_first_token_time_is_recorded_when_the_first_token_arrives(cluster: Cluster) -> None:
    cluster.fast.stall_after = 1  # one token, then silence: the request is far from finished
    with (
        httpx.Client(timeout=10) as client,
        client.stream("POST", cluster.base_url + "/chat/completions", json=_stream_body(max_tokens=5)) as response,
    ):
        lines = response.iter_lines()  # kept: a dropped iterator would close the stream
        for line in lines:
            if '"content"' in line:
                break
        assert wait_until(
            lambda: _summed(cluster, TTFT, pool="fast", backend="fast-1") == 1,
            message='_summed(cluster, TTFT, pool="fast", backend="fast-1") == 1',
        )
        assert cluster.fast.open == 1  # ...while the request is still being served
        status = httpx.get(cluster.router.url + "/router/status").json()
        assert status["pools"]["fast"]["backends"]["fast-1"]["ttft_seconds"]["samples"] == 1
    assert cluster.fast.wait_idle(2)


@pytest.mark.e2e
def test_the_oldest_stream_waiting_for_its_first_token_shows_while_it_waits(cluster: Cluster) -> None:
    cluster.fast.first_token_delay = 30  # a queue inside the engine, as the router sees it

    def status() -> dict[str, Any]:
        backends = httpx.get(cluster.router.url + "/router/status").json()["pools"]["fast"]["backends"]
        view: dict[str, Any] = backends["fast-1"]
        return view

    with (
        httpx.Client(timeout=10) as client,
        client.stream("POST", cluster.base_url + "/chat/completions", json=_stream_body(max_tokens=2)) as response,
    ):
        assert response.status_code == 200
        assert wait_until(
            lambda: cluster.metric(OLDEST, pool="fast", backend="fast-1") > 0.05,
            message='cluster.metric(OLDEST, pool="fast", backend="fast-1") > 0.05',
        )
        assert wait_until(
            lambda: status()["oldest_waiting_first_token_seconds"] > 0.05,
            message='status()["oldest_waiting_first_token_seconds"] > 0.05',
        )
        assert cluster.metric(OLDEST, pool="team", backend="team-1") == 0
    # The client left: nothing waits any more.
    assert wait_until(
        lambda: cluster.metric(OLDEST, pool="fast", backend="fast-1") == 0,
        message='cluster.metric(OLDEST, pool="fast", backend="fast-1") == 0',
    )
    assert status()["oldest_waiting_first_token_seconds"] == 0
    assert cluster.settled_metric("specroute_in_flight_requests", 0, pool="fast", backend="fast-1") == 0


def _spec_counters(drafts: int, accepted: int) -> str:
    lines = [
        f'vllm:spec_decode_num_drafts_total{{model_name="m"}} {drafts}',
        f'vllm:spec_decode_num_draft_tokens_total{{model_name="m"}} {drafts * 3}',
        f'vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} {accepted}',
        'vllm:num_requests_running{model_name="m"} 0',
        'vllm:kv_cache_usage_perc{model_name="m"} 0.0',
    ]
    return "\n".join(lines) + "\n"


@pytest.mark.e2e
def test_the_last_acceptance_is_kept_with_its_age_while_the_engine_idles(make_cluster: Any) -> None:
    with make_cluster(scrape={"interval": 0.02, "stale_after": 1}) as cluster:
        engine = cluster.fast
        engine.metrics = _spec_counters(100, 150)
        assert wait_until(lambda: engine.metrics_served >= 2, message="engine.metrics_served >= 2")
        engine.metrics = _spec_counters(200, 390)  # 240 of the 300 drafted tokens accepted
        seen = engine.metrics_served
        assert wait_until(lambda: engine.metrics_served >= seen + 2, message="engine.metrics_served >= seen + 2")
        # Idle from here on: nothing drafted, so no new reading of acceptance.
        seen = engine.metrics_served
        assert wait_until(lambda: engine.metrics_served >= seen + 3, message="engine.metrics_served >= seen + 3")
        view = httpx.get(cluster.router.url + "/router/status").json()["pools"]["fast"]["backends"]["fast-1"]
        assert view["engine"]["acceptance"] == pytest.approx(0.8)
        assert view["engine"]["accept_length"] == pytest.approx(1 + 240 / 100)
        assert view["engine"]["acceptance_age_seconds"] > 0
        labels = {"pool": "fast", "backend": "fast-1"}
        assert cluster.metric("specroute_engine_spec_acceptance_ratio", **labels) == pytest.approx(0.8)
        assert cluster.metric("specroute_engine_spec_acceptance_age_seconds", **labels) > 0


def test_acceptance_is_used_until_older_than_its_max_age() -> None:
    settings = Settings.model_validate(
        {
            "pools": {"fast": {"speculative": True, "backends": {"f1": {"url": "http://127.0.0.1:1"}}}},
            "scrape": {"acceptance_max_age": 300},
        }
    )
    engine = _pools(settings)["fast"].backends[0].engine
    engine.observe(EngineLoad(acceptance=0.8, accept_length=3.4, scraped_at=100.0))
    engine.observe(EngineLoad(running=0, scraped_at=101.0))  # idle: nothing drafted
    assert engine.accept_length(now=399.0, max_age=300) == 3.4
    assert engine.accept_length(now=401.0, max_age=300) is None


def _pools(settings: Settings) -> Pools:
    pools = Pools()
    pools.configure(settings.pools, settings.health)
    return pools


def _snapshot(pools: Pools, settings: Settings, *, now: float) -> dict[str, Any]:
    return snapshot(
        pools,
        SpeedModel(),
        now=now,
        stale_after=settings.scrape.stale_after,
        kv_threshold=settings.routing.kv_threshold,
        acceptance_max_age=settings.scrape.acceptance_max_age,
    )


def _settings() -> Settings:
    pools = {
        "fast": {"speculative": True, "backends": {"f1": {"url": "http://127.0.0.1:1", "max_concurrency": 8}}},
        "team": {"speculative": False, "backends": {"t1": {"url": "http://127.0.0.1:2"}}},
    }
    return Settings.model_validate({"pools": pools})


@pytest.mark.parametrize(("kv", "queue"), [(0.3, 0), (0.95, 2)])
def test_requests_waiting_count_as_a_queue_only_while_the_engine_has_no_room(kv: float, queue: float) -> None:
    """At 16 users, requests seen waiting at one instant spilled while the engine had free slots
    and KV headroom; they were on their way in, not queueing."""
    settings = _settings()
    pools = _pools(settings)
    pools["fast"].backends[0].engine.observe(EngineLoad(running=4, waiting=2, queued=2, kv_usage=kv, scraped_at=100.0))
    state = _snapshot(pools, settings, now=100.5)
    assert state["fast"].engine_queued == queue


@pytest.mark.e2e
def test_engine_readings_going_stale_and_fresh_again_are_logged(
    make_cluster: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Unhealthy, ejected and back: tests/test_logs.py. Here: an engine whose /metrics stops answering."""
    caplog.set_level(logging.INFO, logger="specroute.backends")
    clock = ManualClock()  # the router's live clock: readings go stale when the test says so
    with make_cluster(scrape={"interval": 0.02, "stale_after": 5}, live_clock=clock) as cluster:
        backend = cluster.app.state.router.pools["fast"].backends[0]

        def logged(text: str) -> list[logging.LogRecord]:
            return [r for r in caplog.records if r.name == "specroute.backends" and text in r.getMessage()]

        cluster.fast.metrics = _spec_counters(1, 1)
        assert wait_until(
            lambda: backend.engine.reading.scraped_at > 0, message="backend.engine.reading.scraped_at > 0"
        )
        cluster.fast.metrics = None  # /metrics now answers 404
        clock.advance(6)  # past stale_after since the last good reading
        [stale] = wait_until(
            lambda: logged("backend fast-1 (pool fast) engine readings stale"),
            message='logged("backend fast-1 (pool fast) engine readings stale")',
        )
        assert stale.levelno == logging.WARNING and "/metrics answered 404" in stale.getMessage()
        cluster.fast.metrics = _spec_counters(1, 1)
        assert wait_until(
            lambda: logged("backend fast-1 (pool fast) engine readings fresh again"),
            message='logged("backend fast-1 (pool fast) engine readings fresh again")',
        )
        assert len(logged("engine readings stale")) == 1  # one line per change, not per scrape


def test_missed_scrapes_do_not_open_the_gate_to_a_full_speculative_engine() -> None:
    """Scrapes that time out (a busy machine) leave no fresh reading: the KV the router's own
    requests take still says the speculative engine is full."""
    settings = _settings()
    pools = _pools(settings)
    backend = pools["fast"].backends[0]
    backend.engine.observe(EngineLoad(running=7, waiting=0, queued=0, kv_usage=0.7, scraped_at=100.0, own_in_flight=7))
    backend.in_flight = 7
    fresh = _snapshot(pools, settings, now=100.5)["fast"].kv_usage
    assert fresh == pytest.approx(0.8)
    later = _snapshot(pools, settings, now=100.0 + settings.scrape.stale_after + 1)
    assert later["fast"].kv_usage == pytest.approx(0.8)  # stale: 7 of its own and the next, at 0.1
    backend.in_flight = 9
    later = _snapshot(pools, settings, now=100.0 + settings.scrape.stale_after + 1)
    assert later["fast"].kv_usage == pytest.approx(1.0)


def test_a_burst_past_both_engines_stated_capacity_is_shared_by_their_projected_queues() -> None:
    """Real vLLM states a capacity of 2 requests (4,096 tokens at max_model_len): on a cold router
    both pools look full from the second request of a burst. The first token is predicted behind
    the router's own requests projected past each KV cache, so the burst goes where fewer wait,
    not all to the speculative pool (with both predicted at 0 s, the speculative one would keep it)."""
    settings = _settings()
    pools = _pools(settings)
    fast, team = pools["fast"].backends[0], pools["team"].backends[0]
    for backend in (fast, team):  # one idle reading each, as on a router just started
        backend.engine.observe(EngineLoad(running=0, waiting=0, kv_usage=0.0, max_concurrency=2.0, scraped_at=100.0))
    fast.in_flight, team.in_flight = 6, 2
    assert fast.overflow(100.2, 5.0, 0.9) == 5  # 0.5 of the cache each: one fits below 0.9
    assert team.overflow(100.2, 5.0, 0.9) == 1
    state = _snapshot(pools, settings, now=100.2)
    assert state["fast"].kv_usage == pytest.approx(3.5) and state["team"].kv_usage == pytest.approx(1.5)
    assert state["fast"].ttft is not None and state["team"].ttft is not None
    assert state["team"].ttft < state["fast"].ttft  # 1 ahead of it on team, 5 on fast
    team.in_flight = 6
    state = _snapshot(pools, settings, now=100.2)
    assert state["team"].ttft == state["fast"].ttft  # as many ahead: neither is sooner


def test_a_pool_with_no_request_measured_takes_the_duration_the_others_measured() -> None:
    """On real engines one short request finished on the speculative pool and none yet on the
    standard one: the standard pool's predicted first token took 10 s a request ahead (an assumed
    constant) against the 1 s measured, and a burst went where the engine already preempted."""
    settings = _settings()
    pools = _pools(settings)
    fast, team = pools["fast"].backends[0], pools["team"].backends[0]
    for backend in (fast, team):
        backend.engine.observe(EngineLoad(running=0, waiting=0, kv_usage=0.0, max_concurrency=2.0, scraped_at=100.0))
    fast.in_flight += 1
    pools["fast"].release(fast, duration=1.0)
    fast.in_flight, team.in_flight = 3, 1
    state = _snapshot(pools, settings, now=100.2)
    assert state["fast"].ttft == pytest.approx(3.0)  # 2 past its KV cache and itself, 1 running, 1 s each
    assert state["team"].ttft == pytest.approx(1.0)  # itself past its KV cache, at the 1 s fast measured


def test_overflow_counts_only_what_the_reading_does_not() -> None:
    engine = EngineView()
    assert engine.overflow(100.0, 5.0, 0.9, in_flight=30, max_concurrency=32) == 0  # no KV figure
    # 8 running at 0.4: 0.05 a request, so 9 more fit below 0.9; 8 of the 20 in flight it counts.
    engine.observe(EngineLoad(running=8, kv_usage=0.4, scraped_at=100.0, own_in_flight=8))
    assert engine.overflow(100.1, 5.0, 0.9, in_flight=17, max_concurrency=32) == 0
    assert engine.overflow(100.1, 5.0, 0.9, in_flight=20, max_concurrency=32) == 3
    # Stale: the router's own requests from an empty cache (0.05 each: 17 fit).
    assert engine.overflow(106.0, 5.0, 0.9, in_flight=20, max_concurrency=32) == 3


@pytest.mark.e2e
def test_a_request_in_flight_counts_in_the_kv_projection_at_its_own_length(cluster: Cluster) -> None:
    """A stream in flight on the standard engine is held there at its own prompt and answer, for
    the next request's KV projection (router.backends.engines), and let go when it ends (here:
    its client leaves, the answer 30 s from its end)."""
    cluster.team.token_delay = 0.5
    backend = cluster.app.state.router.pools["team"].backends[0]
    body = {**_stream_body(), "messages": [{"role": "user", "content": "x" * 4000}], "max_tokens": 60}
    with httpx.stream("POST", cluster.base_url + "/chat/completions", json=body, headers={"X-Route-Pool": "team"}) as r:
        pieces = r.iter_raw()  # kept: a generator dropped closes the response
        next(pieces)  # under way
        assert list(backend.holding.values()) == [1000 + 60]  # 4 characters a token, and its answer
    assert wait_until(lambda: not backend.holding and not backend.in_flight, message="the request let go")
