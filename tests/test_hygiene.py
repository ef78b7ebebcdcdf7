"""Nothing lost, nothing left open: bytes pass unchanged, bad input ends in a 4xx, cancellations leave no trace."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import string
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import Cluster, running_cluster
from tests.wait import wait_until


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


STREAM = (
    _event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    + b"".join(_event({"choices": [{"index": 0, "delta": {"content": f"t{i} \u00e9\u4e2d"}}]}) for i in range(6))
    + _event({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
    + _event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}})
    + b"data: [DONE]\n\n"
)
CLUSTER: dict[str, Cluster] = {}


def _cluster() -> Cluster:
    """One cluster for all examples of a property (hypothesis calls the test many times)."""
    if "c" not in CLUSTER:
        CLUSTER["manager"] = running_cluster()  # type: ignore[assignment]
        CLUSTER["c"] = CLUSTER["manager"].__enter__()  # type: ignore[attr-defined]
    return CLUSTER["c"]


def teardown_module() -> None:
    if "manager" in CLUSTER:
        CLUSTER["manager"].__exit__(None, None, None)  # type: ignore[attr-defined]


@pytest.mark.e2e
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(min_value=1, max_value=len(STREAM) - 1), max_size=30))
def test_any_split_of_the_upstream_stream_reaches_the_client_byte_identical(cuts: list[int]) -> None:
    cluster = _cluster()
    bounds = [0, *sorted(set(cuts)), len(STREAM)]
    cluster.fast.script = [STREAM[a:b] for a, b in itertools.pairwise(bounds)]
    body = {"model": "test-model", "messages": [], "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", cluster.base_url + "/chat/completions", json=body) as response:
        received = b"".join(response.iter_raw())
    assert received == STREAM


# Values a client can send at all: no leading or trailing whitespace (HTTP strips it anyway).
HEADER_TEXT = st.text(alphabet=string.ascii_letters + string.digits + " -_.:;,/=*\t", max_size=40).map(str.strip)
JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)
FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "model": st.one_of(st.just("test-model"), JSONISH),
        "stream": JSONISH,
        "stream_options": JSONISH,
        "n": JSONISH,
        "user": JSONISH,
        "metadata": JSONISH,
        "messages": JSONISH,
        "max_tokens": st.integers(min_value=-5, max_value=8) | JSONISH,
        "tools": JSONISH,
    },
)


@pytest.mark.e2e
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    body=st.one_of(st.binary(max_size=200), FIELDS.map(lambda d: json.dumps(d).encode())),
    headers=st.dictionaries(
        st.sampled_from(["x-route-pool", "x-job-type", "x-request-id", "user-agent", "connection", "te",
                         "authorization", "x-team", "content-type", "upgrade"]),
        HEADER_TEXT,
        max_size=5,
    ),
    path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/x/../y", "/v1/"]),
)  # fmt: skip
def test_fuzzed_requests_end_in_a_clean_answer_or_a_4xx(body: bytes, headers: dict[str, str], path: str) -> None:
    cluster = _cluster()
    cluster.fast.script = None
    response = httpx.post(cluster.router.url + path, content=body, headers=headers, timeout=10)
    assert response.status_code < 500, response.text
    if response.status_code >= 400 and response.headers.get("content-type") == "application/json":
        error = response.json().get("error")
        assert isinstance(error, dict) and error.get("message")


@pytest.mark.e2e
def test_a_storm_of_cancellations_leaves_nothing_open(make_cluster: Any) -> None:
    """1,000 requests, each abandoned at a random moment: before the answer starts, once it has
    started, mid-stream, or not at all. Afterwards every gauge reads zero, no upstream connection is
    checked out, and the engines saw every abandoned request closed.

    Three in four are abandoned at a point of the exchange rather than after a time, so that a busy
    machine, slow to get any answer started, still sees requests abandoned mid-way."""
    with make_cluster() as cluster:
        for engine in (cluster.fast, cluster.team):
            engine.first_token_delay, engine.token_delay = 0.01, 0.01
        rng = random.Random(7)
        left = {"timed": 0, "answer-started": 0, "mid-stream": 0}

        async def one(client: httpx.AsyncClient, number: int) -> None:
            leave = rng.choice(["timed", "answer-started", "mid-stream", "never"])
            stream = number % 3 != 0
            # A stream to be left once started runs long (5 s): it is surely still running when
            # the client is gone, however slowly a busy machine carries that to the engine.
            tokens = 500 if stream and leave in ("answer-started", "mid-stream") else 20
            body = {"model": "test-model", "messages": [], "max_tokens": tokens, "stream": stream}
            headers = {"X-Job-Type": "batch"} if number % 4 == 0 else {}

            async def go() -> None:
                async with client.stream(
                    "POST", cluster.base_url + "/chat/completions", json=body, headers=headers
                ) as r:
                    if leave == "answer-started":
                        left[leave] += stream  # a whole answer has started once it is all there
                        return
                    async for _ in r.aiter_raw():
                        if leave == "mid-stream" and stream:
                            left[leave] += 1
                            return

            with contextlib.suppress(httpx.HTTPError):
                if leave != "timed":
                    await go()
                    return
                try:
                    await asyncio.wait_for(go(), rng.uniform(0.0, 0.08))
                except TimeoutError:
                    left[leave] += 1  # left at a moment: the engine may or may not have had it

        async def storm() -> None:
            async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client:
                for start in range(0, 1000, 50):
                    await asyncio.gather(*(one(client, n) for n in range(start, start + 50)))

        asyncio.run(storm())
        assert cluster.fast.wait_idle() and cluster.team.wait_idle()
        assert left["answer-started"] > 100 and left["mid-stream"] > 100  # the storm did leave mid-way
        # ...and the engines saw it: each stream left once it had started was closed upstream, and
        # a request left at a moment too, if it had reached an engine and was still running there
        # (one did, on a quiet machine: an abort more than the streams left mid-way).
        aborted = cluster.fast.aborted + cluster.team.aborted
        assert left["answer-started"] + left["mid-stream"] <= aborted <= sum(left.values())
        for pool, backend in (("fast", "fast-1"), ("team", "team-1")):
            assert cluster.settled_metric("specroute_in_flight_requests", 0, pool=pool, backend=backend) == 0
            for job in ("interactive", "batch"):
                assert cluster.metric("specroute_queued_requests", pool=pool, job_class=job) == 0
        state = cluster.app.state.router
        # None left checked out; a health probe or a scrape (both backends at once) may be out
        # this moment, and is back within milliseconds.
        wait_until(lambda: state.transport.in_use == 0, message="no upstream response checked out")
        assert sum(p.in_flight for p in state.pools) == 0
        assert not any(b.holding for b in state.pools.backends())  # nor the KV they held
