"""The pool's router-side queue, seen through the router: bounded size, bounded wait, 503s."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.e2e  # the router served on loopback in front of fake engines

POOLS = {"fast": {"queue_size": 1, "queue_timeout": 0.5, "backends": {"fast-1": {"max_concurrency": 1}}}}
STATIC = {"mode": "static"}  # the queue itself is under test: no spilling to the other pool


def _post(url: str) -> httpx.Response:
    return httpx.post(url, json={"model": "test-model", "prompt": "x", "max_tokens": 1}, timeout=10)


def test_full_queue_and_queue_timeout_answer_503_with_retry_after(make_cluster: Any) -> None:
    with make_cluster(pools=POOLS, routing=STATIC) as cluster:
        cluster.fast.first_token_delay = 1.5
        url = cluster.base_url + "/completions"
        with ThreadPoolExecutor(3) as executor:
            first = executor.submit(_post, url)
            assert cluster.settled_metric("specroute_in_flight_requests", 1, pool="fast", backend="fast-1") == 1
            queued = executor.submit(_post, url)
            assert cluster.settled_metric("specroute_queued_requests", 1, pool="fast", job_class="interactive") == 1
            rejected = _post(url)  # the queue holds one: this one is turned away at once
            assert rejected.status_code == 503
            assert rejected.json()["error"]["code"] == "queue_full"
            assert int(rejected.headers["retry-after"]) >= 1
            timed_out = queued.result()
            assert timed_out.status_code == 503
            assert timed_out.json()["error"]["code"] == "queue_timeout"
            assert "retry-after" in timed_out.headers
            assert first.result().status_code == 200
        assert len(cluster.fast.requests) == 1
        assert cluster.metric("specroute_queue_wait_seconds_count", pool="fast", job_class="interactive") == 1
        # Both found the slot taken and joined the queue: one timed out there, one was turned away.
        assert cluster.metric("specroute_queue_entries_total", pool="fast", job_class="interactive") == 2


def test_queued_request_is_served_when_a_slot_frees(make_cluster: Any) -> None:
    pools = {"fast": {"queue_size": 4, "queue_timeout": 5, "backends": {"fast-1": {"max_concurrency": 1}}}}
    with make_cluster(pools=pools, routing=STATIC) as cluster:
        cluster.fast.first_token_delay = 0.3
        with ThreadPoolExecutor(3) as executor:
            results = list(executor.map(_post, [cluster.base_url + "/completions"] * 3))
        assert [r.status_code for r in results] == [200, 200, 200]
        assert cluster.fast.requests
        assert len(cluster.fast.requests) == 3
        # Every request after the first waited for the one before it.
        assert cluster.metric("specroute_queue_wait_seconds_count", pool="fast", job_class="interactive") == 3
        assert cluster.metric("specroute_queue_wait_seconds_sum", pool="fast", job_class="interactive") > 0.5
