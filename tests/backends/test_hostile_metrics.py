"""Hostile engines' `/metrics`: prefix-cache and prefill counters no engine could reach. The
router learns nothing from them that breaks a decision: every request is still served."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.conftest import Cluster, running_cluster
from tests.wait import wait_until

pytestmark = pytest.mark.e2e  # the router served on loopback in front of fake engines

CHAT = {"model": "test-model", "messages": [{"role": "user", "content": "hello " * 200}], "max_tokens": 2}


def _metrics(prompt_tokens: float, cache_hits: float, prefills: int, prefill_seconds: float) -> str:
    return (
        f"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
        f"vllm:prompt_tokens_total {prompt_tokens!r}\nvllm:prefix_cache_hits_total {cache_hits!r}\n"
        f"vllm:request_prefill_time_seconds_count {prefills}\n"
        f"vllm:request_prefill_time_seconds_sum {prefill_seconds!r}\n"
    )


def _scraped_from(served: int, cluster: Cluster) -> Callable[[], bool]:
    return lambda: cluster.fast.metrics_served > served


@pytest.mark.parametrize(
    ("tokens", "seconds"),
    [(1e200, 1.0), (1.0, 1e300), (1e300, 1e300)],
    ids=["tokens", "seconds", "both"],
)
def test_absurd_prefill_counters_break_no_decision(tokens: float, seconds: float) -> None:
    with running_cluster(scrape={"interval": 0.02}) as cluster:
        engine = cluster.fast
        # Counters that grow by `tokens` (or three times that) and `seconds` a scrape: enough
        # intervals, spread enough, for the router to fit a prefill rate from them.
        total_tokens = total_seconds = 0.0
        for interval in range(8):
            total_tokens += tokens * (3 if interval % 2 else 1)
            total_seconds += seconds * (interval % 2)
            engine.metrics = _metrics(total_tokens, 0.0, interval + 1, total_seconds)
            wait_until(_scraped_from(engine.metrics_served, cluster), message="a scrape of the new reading")
        answer = httpx.post(cluster.base_url + "/chat/completions", json=CHAT, timeout=30)
        assert answer.status_code == 200, answer.text
        status = httpx.get(cluster.router.url + "/router/status", timeout=30).json()
        assert status["pools"]["fast"]["in_flight"] == 0
        for family in cluster.registry.collect():
            for sample in family.samples:
                assert not math.isnan(sample.value), sample


_RUNNING, _WAITING, _KV = "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"


def _engine(cluster: Cluster, backend: str = "fast-1") -> Any:
    """The router's view of one of pool `fast`'s engines, as /router/status shows it."""
    status = httpx.get(cluster.router.url + "/router/status", timeout=30).json()
    return status["pools"]["fast"]["backends"][backend]["engine"]


@pytest.mark.parametrize(
    "page",
    [
        f"{_RUNNING} 1{'0' * 400}\n",  # an integer too large for a float
        f'{_RUNNING}{{engine="0"}} 1e308\n{_RUNNING}{{engine="1"}} 1e308\n',  # finite, summed past one
        f"{_RUNNING} 1e308\n{_WAITING} 1e308\n",
        f"{_RUNNING} 8\n{_WAITING} 1\n{_KV} 1e-310\n",  # full, at a usage per request no ratio of it holds
        f"{_RUNNING} -1e308\n{_WAITING} -1e308\n",
    ],
    ids=["huge-integer", "ranks-past-float", "running-and-waiting-past-float", "denormal-usage", "negative"],
)
def test_numbers_no_float_holds_stop_no_scrape_and_no_request(page: str) -> None:
    with running_cluster(scrape={"interval": 0.02}) as cluster:
        engine = cluster.fast
        engine.metrics = page
        # Scraped twice: the scrapes go on after the first reading of it.
        served = engine.metrics_served
        wait_until(lambda: engine.metrics_served > served + 1, message="two scrapes of the page")
        answer = httpx.post(cluster.base_url + "/chat/completions", json=CHAT, timeout=30)
        assert answer.status_code == 200, answer.text
        engine.metrics = f"{_RUNNING} 3\n{_WAITING} 0\n{_KV} 0.25\n"
        wait_until(lambda: _engine(cluster)["running"] == 3, message="the next good page read")


@pytest.mark.parametrize(
    "page",
    [
        "".join(f'{_RUNNING}{{engine="{rank}"}} 1\n' for rank in range(10_000)),
        _RUNNING + '{model_name="' + '\\"' * 10_000 + '"} 1\n',  # escaped quotes: a parse as the line's square
    ],
    ids=["lines", "line"],
)
def test_more_of_the_samples_read_than_any_engine_sends_is_a_failed_scrape(page: str) -> None:
    # prometheus_client's parser takes each line read on the event loop every request waits on:
    # some 8 µs a short line, 8 s a line of 1 MB of escaped quotes. Of a page of such lines at the
    # 64 MiB a scrape may read, no request would be served for minutes.
    with running_cluster(scrape={"interval": 0.02, "stale_after": 0.5}) as cluster:
        engine = cluster.fast
        engine.metrics = f"{_RUNNING} 3\n{_WAITING} 0\n"
        wait_until(lambda: _engine(cluster)["running"] == 3, message="the good page read")
        engine.metrics = page
        served = engine.metrics_served
        wait_until(lambda: engine.metrics_served > served + 1, message="two scrapes of the page")
        # Not read: the last good reading stays, and goes stale.
        assert _engine(cluster)["running"] == 3
        wait_until(lambda: _engine(cluster)["stale"], message="the reading stale")
        answer = httpx.post(cluster.base_url + "/chat/completions", json=CHAT, timeout=30)
        assert answer.status_code == 200, answer.text


def test_a_scrape_failing_as_no_check_foresaw_stops_no_other_backends(caplog: pytest.LogCaptureFixture) -> None:
    # A timestamp of 400 digits: prometheus_client divides it, an int, by 1000, which raises
    # OverflowError (no ValueError, which a page the parser cannot read raises). It ended the
    # scraping of every backend, and said so only at shutdown.
    page = f"{_RUNNING} 1 1{'0' * 400}\n"
    with (
        caplog.at_level(logging.ERROR, logger="specroute.backends"),
        running_cluster(fast_backends=2, scrape={"interval": 0.02, "stale_after": 0.5}) as cluster,
    ):
        failing, other = cluster.fast, cluster.more_fast[0]
        failing.metrics = other.metrics = f"{_RUNNING} 3\n{_WAITING} 0\n"
        wait_until(lambda: _engine(cluster)["running"] == _engine(cluster, "fast-2")["running"] == 3)
        failing.metrics = page
        served = failing.metrics_served
        wait_until(lambda: failing.metrics_served > served + 2, message="three scrapes of the page")
        # A failed scrape, as of a page the parser cannot read: the reading stays, goes stale.
        wait_until(lambda: _engine(cluster)["stale"], message="the reading stale")
        assert _engine(cluster)["running"] == 3
        other.metrics = f"{_RUNNING} 5\n{_WAITING} 0\n"
        wait_until(lambda: _engine(cluster, "fast-2")["running"] == 5, message="the other backend scraped")
        failing.metrics = f"{_RUNNING} 4\n{_WAITING} 0\n"
        wait_until(lambda: _engine(cluster)["running"] == 4, message="the failing one read again")
        assert not _engine(cluster)["stale"]
        failing.metrics = page  # failing the same way again: not logged again
        served = failing.metrics_served
        wait_until(lambda: failing.metrics_served > served + 2, message="three scrapes of the page")
    logged = [record for record in caplog.records if record.exc_info is not None]
    assert len(logged) == 1, [record.getMessage() for record in logged]
    assert "backend fast-1 (pool fast): a scrape failed" in logged[0].getMessage()
    assert logged[0].exc_info is not None and logged[0].exc_info[0] is OverflowError
