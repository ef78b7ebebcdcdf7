"""Room over the cap for a client holding no slot: the pool's queue on its own, the engine's
readings given to it as the scraper would, time on a manual clock (router.backends.newcomers)."""

from __future__ import annotations

import asyncio

import pytest

from router.backends.backend import Backend
from router.backends.engines import Elsewhere, EngineLoad
from router.backends.pools import Pool
from router.clock import ManualClock
from router.config import Backend as BackendConfig
from router.config import Fairness, Routing, Scrape


def _pool(clock: ManualClock, *, slots: int = 8, over: int = 4, queue_size: int = 64) -> Pool:
    backend = Backend("b1", "p", BackendConfig(url="http://127.0.0.1:1", max_concurrency=slots))
    pool = Pool("p", speculative=True, backends=[backend], queue_size=queue_size, queue_timeout=3600, clock=clock)
    pool.newcomers.slots = over
    return pool


def _read(pool: Pool, clock: ManualClock, *, kv_per_request: float = 0.05, kv: bool = True) -> None:
    """A fresh reading of the engine: the router's requests running, each holding `kv_per_request`
    of the KV cache (None: the engine states no KV usage)."""
    [backend] = pool.backends
    running = backend.in_flight
    usage = running * kv_per_request if kv else None
    backend.engine.observe(EngineLoad(running=running, kv_usage=usage, scraped_at=clock.now(), own_in_flight=running))


def _asks(pool: Pool, client: str, count: int, *, job: str = "interactive") -> list[asyncio.Task[Backend]]:
    return [asyncio.create_task(pool.acquire(job, client=client)) for _ in range(count)]  # type: ignore[arg-type]


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def _end(pool: Pool, tasks: list[asyncio.Task[Backend]], client: str) -> None:
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is None:
            pool.release(task.result(), client=client)
        else:
            task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.anyio
async def test_a_client_holding_no_slot_goes_over_the_cap_where_the_engine_has_kv_room() -> None:
    clock = ManualClock()
    pool = _pool(clock)
    agent = _asks(pool, "agent", 10)
    await _settle()
    assert pool.held == {"agent": 8} and pool.queued() == 2
    _read(pool, clock)  # eight running, 40 % of the cache
    # A user's first request goes over the cap at once; its second waits like anyone's.
    user = _asks(pool, "user", 2)
    await _settle()
    assert pool.held == {"agent": 8, "user": 1} and pool.in_flight == 9 and pool.queued() == 3
    assert pool.newcomers.admitted == 1
    # The agent's requests never go over: once the user's ends, the backend is back at its cap.
    pool.release(await user[0], client="user")
    await _settle()
    assert pool.in_flight == 9 and pool.held == {"agent": 8, "user": 1}  # the user's second, over the cap too
    pool.release(await user[1], client="user")
    await _settle()
    assert pool.in_flight == 8 and pool.queued() == 2 and pool.newcomers.admitted == 2
    # One of the agent's ends: now the user is active, the agent leaves that slot free for it
    # (router.backends.share), and nothing is over the cap.
    pool.release(await agent[0], client="agent")
    await _settle()
    assert pool.in_flight == 7 and pool.queued() == 2 and pool.held_back == 2
    await _end(pool, agent, "agent")
    assert pool.held == {}


@pytest.mark.anyio
async def test_over_the_cap_by_the_bound_at_most_first_come_first_over() -> None:
    clock = ManualClock()
    pool = _pool(clock, over=3)
    agent = _asks(pool, "agent", 8)
    await _settle()
    _read(pool, clock, kv_per_request=0.05)
    users = [_asks(pool, f"user-{n}", 1)[0] for n in range(5)]
    await _settle()
    assert pool.in_flight == 11 and pool.queued() == 2  # three over the cap, the bound
    assert [task.done() for task in users] == [True, True, True, False, False]  # in arrival order
    # An over-the-cap request ends: the next newcomer takes its place.
    pool.release(await users[0], client="user-0")
    await _settle()
    assert users[3].done() and not users[4].done() and pool.in_flight == 11
    for n, task in enumerate(users[1:], start=1):
        await _end(pool, [task], f"user-{n}")
    await _end(pool, agent, "agent")
    assert pool.held == {} and pool.in_flight == 0


@pytest.mark.anyio
async def test_over_the_cap_only_below_the_kv_threshold_as_last_read() -> None:
    clock = ManualClock()
    pool = _pool(clock)
    agent = _asks(pool, "agent", 8)
    await _settle()
    _read(pool, clock, kv_per_request=0.1)  # 80 %: one more projects 90 %, not below 0.9
    user = _asks(pool, "user", 1)
    await _settle()
    assert pool.in_flight == 8 and pool.queued() == 1 and pool.newcomers.admitted == 0
    # A reading with more room lets it in at the next wake (the scraper wakes a pool after reading).
    _read(pool, clock, kv_per_request=0.05)
    pool.wake()
    await _settle()
    assert user[0].done() and pool.in_flight == 9 and pool.newcomers.admitted == 1
    await _end(pool, user, "user")
    await _end(pool, agent, "agent")


@pytest.mark.anyio
@pytest.mark.parametrize("why", ["stale", "no kv", "replicas", "no fair share", "off", "batch"])
async def test_no_room_over_the_cap_without_a_reading_that_shows_it(why: str) -> None:
    clock = ManualClock()
    pool = _pool(clock, over=0 if why == "off" else 4)
    pool.fair_share = why != "no fair share"
    agent = _asks(pool, "agent", 8, job="batch" if why == "batch" else "interactive")
    await _settle()
    _read(pool, clock, kv=why != "no kv")
    if why == "stale":
        clock.advance(pool.newcomers.stale_after + 1)
    if why == "replicas":
        [backend] = pool.backends
        backend.max_concurrency = 9  # another replica holds one slot of nine
        backend.elsewhere = Elsewhere(in_flight=1, unread=0)
    user = _asks(pool, "user", 1, job="batch" if why == "batch" else "interactive")
    await _settle()
    assert pool.in_flight == 8 and pool.queued() == 1 and pool.newcomers.admitted == 0
    await _end(pool, [*agent, *user], "agent")


@pytest.mark.anyio
async def test_a_flood_of_distinct_clients_goes_over_the_cap_by_the_bound_only() -> None:
    """Hostile: ten thousand clients, each its own key, ask at once while the pool is full. Four
    go over the cap (the bound), the rest wait in the bounded queue or are refused, and once
    they are gone nothing of them is left."""
    clock = ManualClock()
    pool = _pool(clock, queue_size=1000)
    agent = _asks(pool, "agent", 8)
    await _settle()
    _read(pool, clock, kv_per_request=0.01)  # room for 80 more: only the bound holds them back
    flood = [asyncio.create_task(pool.acquire("interactive", client=f"flood-{n}")) for n in range(10_000)]
    await _settle()
    admitted = [task for task in flood if task.done() and not task.cancelled() and task.exception() is None]
    refused = [task for task in flood if task.done() and not task.cancelled() and task.exception() is not None]
    assert len(admitted) == 4 and pool.in_flight == 12 and pool.newcomers.admitted == 4
    assert pool.queued() == 1000 and len(refused) == 10_000 - 4 - 1000  # queue_full
    # Still at the bound after more readings and wakes.
    _read(pool, clock, kv_per_request=0.01)
    pool.wake()
    await _settle()
    assert pool.in_flight == 12
    for task in flood:
        if task in admitted:
            pool.release(task.result(), client=f"flood-{flood.index(task)}")
        else:
            task.cancel()
    await asyncio.gather(*flood, return_exceptions=True)
    await _end(pool, agent, "agent")
    await _settle()
    assert pool.held == {} and pool.queued() == 0 and pool.in_flight == 0


def test_the_settings_reach_each_pool() -> None:
    pool = _pool(ManualClock(), over=0)
    pool.newcomers.configure(Fairness(newcomer_slots=2), Routing(kv_threshold=0.8), Scrape(stale_after=3))
    assert (pool.newcomers.slots, pool.newcomers.kv_threshold, pool.newcomers.stale_after) == (2, 0.8, 3.0)
