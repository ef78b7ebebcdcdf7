"""A flood of distinct clients named by huge `user` fields: what the router keeps of them (its
client memory, the limits' buckets, the fair share) stays small, whatever a body's size."""

from __future__ import annotations

import gc
import tracemalloc

import httpx
import pytest

from tests.conftest import running_cluster
from tests.wait import wait_until

pytestmark = pytest.mark.e2e  # the router served on loopback in front of fake engines

USERS = 200
USER_BYTES = 256 * 1024  # each `user` a quarter of a MiB: 50 MiB in all
CHAT = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_huge_distinct_users_are_kept_small() -> None:
    with running_cluster(fairness={"default_limits": {"requests_per_minute": 1000}}) as cluster:
        router = cluster.app.state.router
        cluster.fast.record = cluster.team.record = False  # the engines keep nothing either

        def flood() -> None:
            with httpx.Client(base_url=cluster.base_url, timeout=30) as client:
                for number in range(USERS):
                    body = {**CHAT, "user": f"{number:08d}" + "u" * USER_BYTES}
                    answer = client.post("/chat/completions", json=body)
                    assert answer.status_code == 200, answer.text

        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            flood()
            wait_until(
                lambda: cluster.metric("specroute_in_flight_requests", pool="fast", backend="fast-1") == 0,
                message="the flood's requests all ended",
            )
            gc.collect()
            kept = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert len(router.limiter) == USERS  # each its own client, limited on its own...
        assert kept < 5 * 1024 * 1024, f"{kept / 2**20:.1f} MiB kept after {USERS} users of {USER_BYTES} bytes"
