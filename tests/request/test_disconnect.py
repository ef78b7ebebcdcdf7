"""A client that leaves closes its upstream request within a second, and every gauge returns."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest

from tests.conftest import Cluster

pytestmark = pytest.mark.e2e  # the router served on loopback in front of fake engines

CHAT = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def _idle(cluster: Cluster) -> None:
    assert cluster.fast.wait_idle(), "upstream request still open a second after the client left"
    assert cluster.settled_metric("specroute_in_flight_requests", 0, pool="fast", backend="fast-1") == 0
    assert cluster.settled_metric("specroute_queued_requests", 0, pool="fast", job_class="interactive") == 0
    assert (
        cluster.settled_metric(
            "specroute_requests_total",
            1,
            pool="fast",
            backend="fast-1",
            job_class="interactive",
            model="test-model",
            status="499",
            code="",
        )
        == 1
    )


def test_disconnect_mid_stream_closes_upstream(cluster: Cluster) -> None:
    cluster.fast.token_delay = 0.05
    with (
        httpx.Client() as client,
        client.stream("POST", cluster.base_url + "/chat/completions", json={**CHAT, "max_tokens": 1000}) as response,
    ):
        lines = response.iter_lines()
        assert next(lines).startswith("data:")
        assert cluster.fast.open == 1
    _idle(cluster)
    assert cluster.fast.aborted == 1


def test_disconnect_before_first_token_closes_upstream(cluster: Cluster) -> None:
    cluster.fast.first_token_delay = 30
    with (
        httpx.Client() as client,
        client.stream("POST", cluster.base_url + "/chat/completions", json={**CHAT, "max_tokens": 5}) as response,
    ):
        assert response.status_code == 200  # headers and the role-only chunk, no content yet
    _idle(cluster)
    assert cluster.fast.aborted == 1


def test_disconnect_while_waiting_for_whole_response(cluster: Cluster) -> None:
    cluster.fast.first_token_delay = 30
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(cluster.base_url + "/completions", json={"model": "test-model", "prompt": "x"}, timeout=0.5)
    _idle(cluster)
    assert cluster.fast.aborted == 1


def test_disconnect_while_queued_leaves_the_queue(make_cluster: Any) -> None:
    pools = {"fast": {"queue_size": 4, "backends": {"fast-1": {"max_concurrency": 1}}}}
    with make_cluster(pools=pools, routing={"mode": "static"}) as cluster:
        cluster.fast.first_token_delay = 1.0
        holder = threading.Thread(
            target=httpx.post,
            args=(cluster.base_url + "/completions",),
            kwargs={"json": {"model": "test-model", "prompt": "x"}, "timeout": 10},
        )
        holder.start()
        assert cluster.settled_metric("specroute_in_flight_requests", 1, pool="fast", backend="fast-1") == 1
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(cluster.base_url + "/completions", json={"model": "test-model", "prompt": "y"}, timeout=0.3)
        assert cluster.settled_metric("specroute_queued_requests", 0, pool="fast", job_class="interactive") == 0
        holder.join()
        assert len(cluster.fast.requests) == 1  # the one that left was never forwarded
        assert cluster.settled_metric("specroute_in_flight_requests", 0, pool="fast", backend="fast-1") == 0
