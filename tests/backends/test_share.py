"""Room kept on a contended pool for the clients that ask little: the pool's queue on its own,
its time driven by a manual clock (router.backends.share)."""

from __future__ import annotations

import asyncio
import time

import pytest

from router.backends.backend import Backend
from router.backends.pools import Pool
from router.backends.share import LIMIT
from router.clock import ManualClock, MonotonicClock
from router.config import Backend as BackendConfig
from tests.wait import until


def _pool(clock: ManualClock | MonotonicClock, *, slots: int = 8, window: float = 30.0) -> Pool:
    backend = Backend("b1", "p", BackendConfig(url="http://127.0.0.1:1", max_concurrency=slots))
    pool = Pool("p", speculative=True, backends=[backend], queue_size=64, queue_timeout=3600, clock=clock)
    pool.active.window = window
    return pool


async def _visit(pool: Pool, client: str) -> None:
    """`client` asks for a slot and gives it back: active, holding none."""
    pool.release(await pool.acquire("interactive", client=client), client=client)


def _asks(pool: Pool, client: str, count: int, *, weight: float = 1.0) -> list[asyncio.Task[Backend]]:
    return [asyncio.create_task(pool.acquire("interactive", client=client, weight=weight)) for _ in range(count)]


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


@pytest.mark.anyio
async def test_a_client_alone_takes_every_slot() -> None:
    pool = _pool(ManualClock())
    agent = _asks(pool, "agent", 10)
    await _settle()
    assert pool.held == {"agent": 8} and pool.queued() == 2
    assert pool.held_back == 0  # no free slot was left: they wait as in any full pool
    for task in agent:
        task.cancel()
    await asyncio.gather(*agent, return_exceptions=True)


@pytest.mark.anyio
async def test_a_heavy_client_leaves_a_slot_free_for_each_other_active_client() -> None:
    clock = ManualClock()
    pool = _pool(clock)
    for user in ("a", "b", "c", "d", "e"):
        await _visit(pool, user)
    agent = _asks(pool, "agent", 10)
    await _settle()
    # Eight slots, five users active and holding none: the agent takes three, and its seven
    # others wait although five slots are free.
    assert pool.held == {"agent": 3} and pool.queued() == 7 and pool.in_flight == 3
    assert pool.held_back == 7
    # A user asking again finds a slot at once, and the agent still may not take the last four.
    slot = await pool.acquire("interactive", client="a")
    assert pool.held == {"agent": 3, "a": 1} and pool.queued() == 7
    pool.release(slot, client="a")
    # An agent's request ends: one of its waiting ones takes the slot, no more.
    pool.release(await agent[0], client="agent")
    await _settle()
    assert pool.held == {"agent": 3} and pool.queued() == 6
    assert pool.held_back == 7  # each request is counted once
    # The users go quiet: after the window the agent takes every slot, at the next wake.
    clock.advance(30.0)
    pool.release(await agent[1], client="agent")
    await _settle()
    assert pool.held == {"agent": 8} and pool.queued() == 0
    for task in agent:
        pool.release(await task, client="agent")
    assert pool.held == {}


@pytest.mark.anyio
@pytest.mark.parametrize(("weight", "takes"), [(1.0, 2), (4.0, 3)])
async def test_a_client_under_its_share_is_never_held_back(weight: float, takes: int) -> None:
    # Four slots, two users active and holding none. Of weight 1 the agent's share is 4/3: past
    # it, it leaves a slot free for each user, so it takes two. Of weight 4 its share is 8/3:
    # it takes three, though that leaves one slot for the two users.
    pool = _pool(ManualClock(), slots=4)
    await _visit(pool, "b")
    await _visit(pool, "c")
    agent = _asks(pool, "agent", 4, weight=weight)
    await _settle()
    assert pool.held == {"agent": takes} and pool.queued() == 4 - takes
    for task in agent:
        task.cancel()
    await asyncio.gather(*agent, return_exceptions=True)


@pytest.mark.anyio
async def test_without_fair_share_or_room_kept_the_pool_is_work_conserving() -> None:
    for fair_share, keep_room in ((False, True), (True, False)):
        pool = _pool(ManualClock())
        pool.fair_share, pool.active.keep_room = fair_share, keep_room
        await _visit(pool, "a")
        agent = _asks(pool, "agent", 10)
        await _settle()
        assert pool.held == {"agent": 8} and pool.held_back == 0
        for task in agent:
            task.cancel()
        await asyncio.gather(*agent, return_exceptions=True)


@pytest.mark.anyio
async def test_a_held_back_request_gets_its_slot_when_the_others_go_inactive() -> None:
    # No slot frees: the pool looks again when the user's window ends (the event loop's timer).
    pool = _pool(MonotonicClock(), slots=2, window=0.3)
    await _visit(pool, "user")
    agent = _asks(pool, "agent", 2)
    await _settle()
    assert pool.held == {"agent": 1} and pool.queued() == 1
    await until(lambda: pool.held == {"agent": 2}, message="the agent's second request admitted")
    assert len(pool.active) == 1  # the user is forgotten, the agent (holding) is not
    for task in agent:
        pool.release(await task, client="agent")


@pytest.mark.anyio
async def test_a_flood_of_distinct_clients_keeps_the_memory_and_the_cost_bounded() -> None:
    """Hostile: thirty thousand clients, each its own key, ask once each. The pool remembers at
    most LIMIT of them, a request costs no more with LIMIT remembered than with few, a user is
    served at once, and once the window has passed nothing of the flood is left."""
    clock = ManualClock()
    pool = _pool(clock)
    agent = _asks(pool, "agent", 4)
    await _settle()
    assert pool.held == {"agent": 4}  # alone: no room kept
    costs = []
    for batch in range(3):
        started = time.perf_counter()
        for number in range(10_000):
            await _visit(pool, f"flood-{batch}-{number}")
        costs.append(time.perf_counter() - started)
        assert len(pool.active) <= LIMIT
    assert costs[-1] < costs[0] * 3, costs  # the first batch grew the memory from nothing
    # The agent, past its share among ten thousand, waits for a fifth; a user is served at once.
    fifth = _asks(pool, "agent", 1)
    await _settle()
    assert pool.held == {"agent": 4} and pool.queued() == 1
    await _visit(pool, "user")
    # The flood and the user go quiet: at the next wake the agent is alone again.
    clock.advance(30.0)
    pool.release(await agent[0], client="agent")
    await _settle()
    assert len(pool.active) == 1 and pool.held == {"agent": 4} and pool.queued() == 0
    for task in [*agent[1:], *fifth]:
        pool.release(await task, client="agent")
    assert pool.held == {}
