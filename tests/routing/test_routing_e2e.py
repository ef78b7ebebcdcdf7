"""Speculation-aware routing end to end: the simulated engines, real routers, real streams."""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from router.app import create_app
from router.backends.scrape import engine_load, parse
from router.config import Settings
from router.content import ContentKind
from router.demo import cluster_settings
from router.prompts import prompts
from router.sim.profile import load_profile
from router.sim.server import create_sim_app
from tests.servers import ServerThread
from tests.wait import until, wait_until

pytestmark = pytest.mark.e2e  # simulated engines and real routers at speed

# Fast enough for a test, slow enough that a 512-token stream (about 9 s at real speed) is still
# running while a busy machine starts the next users and takes the next scrapes.
SCALE = 4


@contextmanager
def engines(scale: float = SCALE) -> Iterator[tuple[str, str]]:
    with (
        ServerThread(create_sim_app(load_profile("fast"), time_scale=scale)) as fast,
        ServerThread(create_sim_app(load_profile("team"), time_scale=scale)) as team,
    ):
        yield fast.url, team.url


def _router(fast: str, team: str, classify: dict[str, Any] | None = None, **routing: Any) -> ServerThread:
    data: dict[str, Any] = {
        "pools": {
            "fast": {"speculative": True, "backends": {"fast-1": {"url": fast, "max_concurrency": 256}}},
            "team": {"speculative": False, "backends": {"team-1": {"url": team, "max_concurrency": 256}}},
        },
        "routing": routing,
        "scrape": {"interval": 0.05, "stale_after": 2},
        "batch": {"store_dir": tempfile.mkdtemp(prefix="specroute-batches-")},
        "classify": classify or {},
    }
    return ServerThread(create_app(Settings(**data), registry=CollectorRegistry()), fast=True)


def _body(kind: ContentKind, number: int) -> dict[str, Any]:
    texts = prompts(kind)
    return {
        "model": "glm-5.3-flash",
        "messages": [{"role": "user", "content": texts[number % len(texts)]}],
        "max_tokens": 512,
        "ignore_eos": True,
        "stream": True,
    }


def _client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=200))


async def _start(
    client: httpx.AsyncClient, router: str, users: range, kind: ContentKind
) -> tuple[list[dict[str, str]], list[asyncio.Task[None]]]:
    """Start one streaming request per user, each once the one before has its answer's headers
    (people do not click at the same microsecond); return the headers and the running streams."""
    seen: list[dict[str, str]] = []

    async def user(number: int, answered: asyncio.Event) -> None:
        body = {**_body(kind, number), "user": f"user-{number}"}  # one key, told apart by `user`
        async with client.stream("POST", router + "/v1/chat/completions", json=body) as response:
            seen.append(dict(response.headers))
            answered.set()
            async for _ in response.aiter_bytes():
                pass

    tasks = []
    for number in users:
        answered = asyncio.Event()
        tasks.append(asyncio.create_task(user(number, answered)))
        await asyncio.wait_for(answered.wait(), 30)
    return seen, tasks


def _engine(url: str) -> dict[str, float | None]:
    load = engine_load(parse(httpx.get(url + "/metrics").text), None, now=0)
    return {"running": load.running, "waiting": load.waiting}


async def _engine_when(url: str, condition: Callable[[dict[str, float | None]], bool]) -> dict[str, float | None]:
    """The engine's load if it meets `condition`, else an empty dict (to wait on)."""
    state = await asyncio.to_thread(_engine, url)
    return state if condition(state) else {}


def _status_when(router: str, condition: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The router's /router/status if it meets `condition`, else an empty dict (to wait on)."""
    status: dict[str, Any] = httpx.get(router + "/router/status").json()
    return status if condition(status) else {}


def _accepting(status: dict[str, Any]) -> bool:
    return status["pools"]["fast"]["backends"]["fast-1"]["engine"]["acceptance"] is not None


def _running_seen_by(router: str, running: int) -> bool:
    status = _status_when(router, lambda s: s["pools"]["fast"]["backends"]["fast-1"]["engine"]["running"] == running)
    return bool(status)


def _stop(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()


@pytest.mark.parametrize("mode", ["crossover", "adaptive"])
def test_interactive_users_spill_before_the_speculative_engine_queues(mode: str) -> None:
    with engines() as (fast, team), _router(fast, team, mode=mode) as router:

        async def scenario() -> tuple[list[dict[str, str]], dict[str, float | None]]:
            async with _client() as client:
                seen, tasks = await _start(client, router.url, range(30), "prose")
                # A request sits in the engine's waiting list until its next step; on a busy
                # machine that can take a moment. What must not happen is a queue that stays.
                state = await until(
                    lambda: _engine_when(fast, lambda state: not state["waiting"]), message="nobody waits in fast"
                )
                _stop(tasks)
                await asyncio.gather(*tasks, return_exceptions=True)
            return seen, state

        seen, fast_engine = asyncio.run(scenario())
    pools = Counter(h["x-route-pool"] for h in seen)
    reasons = Counter(h["x-route-reason"] for h in seen if h["x-route-pool"] == "team")
    assert pools["fast"] >= 4  # the first users get speculation
    assert pools["team"] >= 5  # ...the rest spill
    # On a machine too busy for the simulator to keep up, a request may be seen waiting on two
    # scrapes running: then `spill:spec-queueing` is the true reason.
    allowed = {"spill:past-crossover", "spill:faster-on-standard", "spill:spec-kv-full", "spill:spec-queueing"}
    assert set(reasons) <= allowed
    assert all(h["x-job-type"] == "interactive" for h in seen)
    assert fast_engine["waiting"] == 0  # nobody queues inside the speculative engine


def test_code_keeps_the_speculative_pool_longer_than_prose() -> None:
    counts = {}
    kinds: tuple[ContentKind, ...] = ("prose", "code")
    for kind in kinds:
        with engines() as (fast, team), _router(fast, team, mode="crossover") as router:

            async def scenario(kind: ContentKind = kind) -> list[dict[str, str]]:
                async with _client() as client:
                    seen, tasks = await _start(client, router.url, range(12), kind)
                    _stop(tasks)
                    await asyncio.gather(*tasks, return_exceptions=True)
                return seen

            counts[kind] = Counter(h["x-route-pool"] for h in asyncio.run(scenario()))["fast"]
    assert counts["code"] > counts["prose"]


def test_two_routers_together_keep_the_speculative_engine_at_its_crossover() -> None:
    with ExitStack() as stack:
        fast, team = stack.enter_context(engines())
        first = stack.enter_context(_router(fast, team, mode="crossover"))
        second = stack.enter_context(_router(fast, team, mode="crossover"))

        async def scenario() -> tuple[list[dict[str, str]], list[dict[str, str]], dict[str, float | None]]:
            async with _client() as client:
                seen_first, tasks = await _start(client, first.url, range(3), "prose")
                await until(
                    lambda: asyncio.to_thread(_running_seen_by, second.url, 3),
                    message="the second router's scrape shows the first one's three",
                )
                seen_second, more = await _start(client, second.url, range(100, 104), "prose")
                # Four running, once the engine has stepped: what matters is that it is not five.
                state = await until(
                    lambda: _engine_when(fast, lambda state: (state["running"] or 0) >= 4),
                    message="the engine runs the four routed to it",
                )
                _stop(tasks + more)
                await asyncio.gather(*tasks, *more, return_exceptions=True)
            return seen_first, seen_second, state

        seen_first, seen_second, fast_engine = asyncio.run(scenario())
    assert [h["x-route-pool"] for h in seen_first] == ["fast"] * 3
    second_pools = Counter(h["x-route-pool"] for h in seen_second)
    assert second_pools == {"fast": 1, "team": 3}  # 3 + 1 = the prose crossover, 4
    assert fast_engine["running"] == 4


def test_status_and_metrics_explain_the_live_state() -> None:
    with engines() as (fast, team), _router(fast, team, mode="adaptive") as router:

        async def scenario() -> dict[str, Any]:
            async with _client() as client:
                _, tasks = await _start(client, router.url, range(6), "code")
                # Read while the streams run: acceptance is over the last scrape interval, and an
                # interval without drafts has none.
                while_running: dict[str, Any] = await until(
                    lambda: asyncio.to_thread(_status_when, router.url, _accepting),
                    message="the status shows the engine's acceptance",
                )
                _stop(tasks)
                await asyncio.gather(*tasks, return_exceptions=True)
            return while_running

        while_running = asyncio.run(scenario())
        # Finish a few streams so there is something learned.
        for number in range(3):
            body = {**_body("code", number), "max_tokens": 64}
            with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=30) as response:
                for _ in response.iter_bytes():
                    pass
        status = wait_until(
            lambda: _status_when(router.url, lambda s: bool(s["pools"]["fast"]["backends"]["fast-1"]["speed_curve"])),
            message="a speed learned",
        )
        metrics = httpx.get(router.url + "/metrics").text
    assert status["routing"]["mode"] == "adaptive"
    backend = status["pools"]["fast"]["backends"]["fast-1"]
    assert backend["engine"]["stale"] is False
    assert while_running["pools"]["fast"]["backends"]["fast-1"]["engine"]["acceptance"] is not None
    assert backend["ttft_seconds"]["samples"] >= 3
    assert backend["speed_curve"]["code"][0]["tokens_per_second"] > 0
    assert "learned_crossover" in backend
    assert json.dumps(status)  # plain JSON all the way down
    for name in (
        "specroute_engine_running_requests",
        "specroute_engine_kv_cache_usage_ratio",
        "specroute_engine_spec_acceptance_ratio",
        'specroute_route_decisions_total{content="code"',
    ):
        assert name in metrics, name


def test_a_new_batch_jobs_first_burst_never_lands_on_the_speculative_pool() -> None:
    # A hold long enough for all twenty to arrive on a busy machine (the default is 20 ms); the
    # burst ends it as soon as it shows, well before.
    classify = {"burst_hold_seconds": 2.0}
    with engines() as (fast, team), _router(fast, team, classify, mode="adaptive") as router:

        async def scenario() -> list[dict[str, str]]:
            async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=40)) as client:
                headers = {"authorization": "Bearer etl-job"}  # one key, many requests at once
                body = {**_body("prose", 0), "stream": False, "max_tokens": 8}
                responses = await asyncio.gather(
                    *(client.post(router.url + "/v1/chat/completions", json=body, headers=headers) for _ in range(20))
                )
            return [dict(r.headers) for r in responses]

        seen = asyncio.run(scenario())
    assert {h["x-route-pool"] for h in seen} == {"team"}
    assert {h["x-job-type"] for h in seen} == {"batch"}


# Slower than the other tests here: the router's own milliseconds on a busy machine, counted
# twenty times, would blur first tokens of a few seconds.
BURST_SCALE = 5
BATCH = 40  # more than the users: the crossover rule alone would never spill them


def test_a_burst_of_users_on_a_cold_router_spills_past_the_speculative_engines_capacity() -> None:
    """24 interactive users at the same moment beside a batch job, on a router that has never seen
    the engines loaded: the speculative engine holds 23 (its KV cache), so not all may go there,
    and nobody may wait there for the others to finish (45 s, as on the engine alone)."""
    with engines(BURST_SCALE) as (fast, team):
        settings = cluster_settings(
            {"fast": (True, [fast]), "team": (False, [team])}, host="127.0.0.1", port=0, time_scale=BURST_SCALE
        )
        # The batch job's forty connections open within the demo's 4 ms hold only on an idle
        # machine: a hold long enough for a busy one (its burst ends it as soon as it shows). Each
        # user is new too, so their first tokens include it: 1.25 s simulated at most.
        classify = settings.classify.model_copy(update={"burst_hold_seconds": 0.25})
        settings = settings.model_copy(update={"classify": classify})
        with ServerThread(create_app(settings, registry=CollectorRegistry()), fast=True) as router:

            async def scenario() -> tuple[list[str], list[float], list[str]]:
                async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=80)) as client:
                    url = router.url + "/v1/chat/completions"
                    batch_seen: list[str] = []
                    batch_running = asyncio.Event()

                    async def batch(number: int) -> None:
                        body = {**_body("prose", number), "max_tokens": 2048}  # runs through the burst
                        headers = {"authorization": "Bearer etl-job"}  # one key, no `user`
                        async with client.stream("POST", url, json=body, headers=headers) as response:
                            batch_seen.append(response.headers["x-route-pool"])
                            if len(batch_seen) == BATCH:
                                batch_running.set()
                            async for _ in response.aiter_bytes():
                                pass

                    async def user(number: int) -> tuple[str, float]:
                        body = {**_body("prose", number), "max_tokens": 256, "user": f"user-{number}"}
                        started = time.monotonic()
                        async with client.stream("POST", url, json=body) as response:
                            async for line in response.aiter_lines():
                                if '"content"' in line:
                                    return response.headers["x-route-pool"], (time.monotonic() - started) * BURST_SCALE
                        raise AssertionError("no first token")

                    jobs = [asyncio.create_task(batch(n)) for n in range(BATCH)]
                    await asyncio.wait_for(batch_running.wait(), 30)  # the batch job runs before the users arrive
                    results = await asyncio.gather(*(user(n) for n in range(24)))
                    _stop(jobs)
                    await asyncio.gather(*jobs, return_exceptions=True)
                return [pool for pool, _ in results], [ttft for _, ttft in results], batch_seen

            pools, ttfts, batch_pools = asyncio.run(scenario())
    assert set(batch_pools) == {"team"}
    assert pools.count("team") > 0 and pools.count("fast") <= 23, Counter(pools)
    assert max(ttfts) < 15, sorted(ttfts)  # seconds, simulated (real) time; 45 s before


@pytest.mark.parametrize("limit", [10**400, 2**63, -(10**400)])
def test_an_answer_limit_of_any_integer_is_the_engines_to_refuse(limit: int) -> None:
    """A client's `max_tokens` becomes the KV its request is projected to take (router.content,
    router.engines): one past what a float holds must not make the projection raise (a 500), but
    reach the engine, whose 400 the client gets."""
    with engines() as (fast, team), _router(fast, team) as router:
        wait_until(
            lambda: (
                httpx.get(router.url + "/router/status").json()["pools"]["fast"]["backends"]["fast-1"]["engine"][
                    "stated_max_concurrency"
                ]
                is not None
            ),
            message="the engine's stated KV cache read",
        )
        body = json.dumps({**_body("prose", 0), "stream": False}).replace('"max_tokens": 512', f'"max_tokens": {limit}')
        answer = httpx.post(router.url + "/v1/chat/completions", content=body, timeout=30)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == "max_tokens"
        assert answer.headers["x-route-pool"] == "fast"  # routed, and the engine's own answer passed on
