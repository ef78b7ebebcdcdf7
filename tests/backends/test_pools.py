"""The pool queue on its own: priority, bounds, hand-over on cancellation; the engine view's KV projection."""

from __future__ import annotations

import asyncio

import pytest

from router.backends.backend import Backend
from router.backends.engines import EngineLoad
from router.backends.pools import Pool, Pools
from router.config import Backend as BackendConfig
from router.config import Settings
from router.errors import NoBackendAvailable


def _pool(*, slots: int = 1, queue_size: int = 8, queue_timeout: float = 5.0) -> Pool:
    backend = Backend("b1", "p", BackendConfig(url="http://127.0.0.1:1", max_concurrency=slots))
    return Pool("p", speculative=True, backends=[backend], queue_size=queue_size, queue_timeout=queue_timeout)


@pytest.mark.anyio
async def test_interactive_requests_are_admitted_before_queued_batch() -> None:
    pool = _pool()
    holder = await pool.acquire("batch")
    order: list[str] = []

    async def wait(name: str, job: str) -> None:
        backend = await pool.acquire(job)  # type: ignore[arg-type]
        order.append(name)
        pool.release(backend)

    tasks = [asyncio.create_task(wait("batch-1", "batch"))]
    await asyncio.sleep(0)
    tasks.append(asyncio.create_task(wait("inter-1", "interactive")))
    await asyncio.sleep(0)
    assert pool.queued("batch") == 1
    assert pool.queued("interactive") == 1
    pool.release(holder)
    await asyncio.gather(*tasks)
    assert order == ["inter-1", "batch-1"]
    assert pool.in_flight == 0
    assert pool.queued() == 0


@pytest.mark.anyio
async def test_least_loaded_backend_is_chosen() -> None:
    a = Backend("a", "p", BackendConfig(url="http://127.0.0.1:1", max_concurrency=4))
    b = Backend("b", "p", BackendConfig(url="http://127.0.0.1:2", max_concurrency=2))
    pool = Pool("p", speculative=False, backends=[a, b], queue_size=0, queue_timeout=1)
    chosen = [(await pool.acquire("batch")).name for _ in range(6)]
    # a: 0/4 b: 0/2 -> a (1/4) -> b (1/2) -> a (2/4) -> a (3/4)... lowest ratio each time.
    assert chosen == ["a", "b", "a", "a", "b", "a"]
    with pytest.raises(NoBackendAvailable):
        await pool.acquire("batch")


@pytest.mark.anyio
async def test_unhealthy_backends_are_skipped_and_a_dead_pool_fails_fast() -> None:
    pool = _pool(slots=4)
    pool.backends[0].outlier.healthy = False
    with pytest.raises(NoBackendAvailable) as caught:
        await pool.acquire("interactive")
    assert caught.value.code == "pool_unavailable"
    assert pool.queued() == 0


@pytest.mark.anyio
async def test_cancelled_waiter_leaves_the_queue_and_loses_no_slot() -> None:
    pool = _pool()
    holder = await pool.acquire("interactive")
    waiter = asyncio.create_task(pool.acquire("interactive"))
    await asyncio.sleep(0)
    assert pool.queued() == 1
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert pool.queued() == 0
    pool.release(holder)
    assert pool.in_flight == 0
    assert (await pool.acquire("interactive")) is holder


@pytest.mark.anyio
async def test_slot_handed_to_a_waiter_that_is_cancelled_is_passed_on() -> None:
    pool = _pool()
    holder = await pool.acquire("interactive")
    first = asyncio.create_task(pool.acquire("interactive"))
    second = asyncio.create_task(pool.acquire("interactive"))
    await asyncio.sleep(0)
    pool.release(holder)  # hands the slot to `first`...
    first.cancel()  # ...which leaves before it runs again
    with pytest.raises(asyncio.CancelledError):
        await first
    backend = await asyncio.wait_for(second, 1)
    assert backend is holder
    assert pool.in_flight == 1
    assert pool.queued() == 0


@pytest.mark.anyio
async def test_queue_wait_is_bounded() -> None:
    pool = _pool(queue_timeout=0.05)
    await pool.acquire("interactive")
    with pytest.raises(NoBackendAvailable) as caught:
        await pool.acquire("interactive")
    assert caught.value.code == "queue_timeout"
    assert pool.queued() == 0


@pytest.mark.anyio
async def test_slot_freed_while_a_cancelled_waiter_is_still_queued_goes_to_the_next() -> None:
    """The race the cancellation storm found: a waiter cancelled, and a slot freed before its
    task ran again. The slot must go to the next live waiter, not be lost."""
    pool = _pool()
    holder = await pool.acquire("interactive")
    first = asyncio.create_task(pool.acquire("interactive"))
    second = asyncio.create_task(pool.acquire("interactive"))
    await asyncio.sleep(0)
    first.cancel()  # its future is cancelled now; its task has not yet run to clean up
    pool.release(holder)
    assert (await asyncio.wait_for(second, 1)) is holder
    with pytest.raises(asyncio.CancelledError):
        await first
    assert pool.in_flight == 1 and pool.queued() == 0


def test_kv_usage_is_projected_with_the_requests_sent_since_the_scrape() -> None:
    now = 100.0
    backend = Backend("b1", "p", BackendConfig(url="http://127.0.0.1:1", max_concurrency=64))
    assert backend.kv_projected(now, 5) is None  # nothing scraped yet
    backend.in_flight = 10
    backend.engine.observe(EngineLoad(running=10, waiting=0, kv_usage=0.40, scraped_at=now, own_in_flight=10))
    assert backend.kv_projected(now, 5) == pytest.approx(0.44)  # 4 % a request, the next one included
    backend.in_flight = 15  # five more sent since the scrape: the engine has not reported them yet
    assert backend.kv_projected(now, 5) == pytest.approx(0.64)
    # Stale (scrapes missed): what its own 15 and the next take, at the usage last seen.
    assert backend.kv_projected(now + 10, 5) == pytest.approx(0.64)


@pytest.mark.anyio
async def test_queued_requests_fail_at_once_when_the_last_backend_is_drained() -> None:
    """Pass: the queued request gets 503 `pool_unavailable` as soon as the drain is applied, not
    at the end of queue_timeout; the running one keeps its slot."""
    pool = _pool(slots=1, queue_timeout=30)
    running = await pool.acquire("interactive")
    queued = asyncio.create_task(pool.acquire("batch"))
    await asyncio.sleep(0)
    assert pool.queued() == 1
    running.draining = True
    pool.wake()
    with pytest.raises(NoBackendAvailable, match="being drained"):
        await asyncio.wait_for(queued, 1)
    assert pool.queued() == 0 and running.in_flight == 1
    pool.release(running)
    assert running.in_flight == 0


def test_reconcile_keeps_a_backend_with_the_same_url_and_names_the_others() -> None:
    """Pass: a backend configured again at the same URL is the same object (its in-flight count
    and health stay), one at a new URL is new, and the names of the new and the gone come back."""

    def settings(**backends: str) -> Settings:
        pools = {"p": {"speculative": True, "backends": {n: {"url": u} for n, u in backends.items()}}}
        return Settings(pools=pools)  # type: ignore[arg-type]

    def configure(pools: Pools, settings: Settings) -> set[str]:
        return pools.configure(settings.pools, settings.health)

    pools = Pools()
    configure(pools, settings(a="http://a:1", b="http://b:1", c="http://c:1"))
    a = pools["p"].backends[0]
    a.in_flight, a.outlier.healthy = 3, False
    replaced = configure(pools, settings(a="http://a:1", b="http://b:2", d="http://d:1"))
    kept = {backend.name: backend for backend in pools["p"].backends}
    assert kept["a"] is a and (a.in_flight, a.healthy) == (3, False)
    assert replaced == {"b", "c", "d"}


async def _admission_order(
    pool: Pool, requests: list[tuple[str, str]], *, weights: dict[str, float] | None = None
) -> list[str]:
    """Queue `requests` (name, client) on a full one-slot pool in this order; free the slot and
    return the order in which they were admitted, each holding its slot until the next is in.
    The order alone: no room is kept for the others (router.backends.share)."""
    pool.active.keep_room = False
    holder = await pool.acquire("interactive", client="holder")
    order: list[str] = []
    handed: list[tuple[str, Backend]] = []

    async def wait(name: str, client: str) -> None:
        backend = await pool.acquire("interactive", client=client, weight=(weights or {}).get(client, 1.0))
        order.append(name)
        handed.append((client, backend))

    tasks = []
    for name, client in requests:
        tasks.append(asyncio.create_task(wait(name, client)))
        await asyncio.sleep(0)
    pool.release(holder, client="holder")
    while len(order) < len(requests):
        await asyncio.sleep(0)
        if handed:
            handed.pop()
            # Admitted: it keeps its slot (counted for its client) and another slot opens.
            pool.backends[0].max_concurrency += 1
            pool.wake()
    await asyncio.gather(*tasks)
    return order


@pytest.mark.anyio
async def test_a_client_with_many_slots_waits_behind_those_with_few() -> None:
    # The agent queued five before the chat users' one each; with fair share each user's goes
    # first once the agent holds a slot, then the agent's in their order.
    requests = [(f"agent-{i}", "agent") for i in range(5)] + [("alice", "alice"), ("bob", "bob")]
    order = await _admission_order(_pool(queue_size=16), requests)
    assert order == ["agent-0", "alice", "bob", "agent-1", "agent-2", "agent-3", "agent-4"]


@pytest.mark.anyio
async def test_without_fair_share_the_queue_is_first_come_first_served() -> None:
    pool = _pool(queue_size=16)
    pool.fair_share = False
    requests = [(f"agent-{i}", "agent") for i in range(3)] + [("alice", "alice")]
    assert await _admission_order(pool, requests) == ["agent-0", "agent-1", "agent-2", "alice"]


@pytest.mark.anyio
async def test_two_busy_clients_alternate_and_a_weight_gives_a_larger_share() -> None:
    requests = [(f"a-{i}", "a") for i in range(4)] + [(f"b-{i}", "b") for i in range(4)]
    order = await _admission_order(_pool(queue_size=16), requests)
    assert order == ["a-0", "b-0", "a-1", "b-1", "a-2", "b-2", "a-3", "b-3"]
    # Weight 2: b is admitted as if it held half its slots, so it gets two for a's one.
    order = await _admission_order(_pool(queue_size=16), requests, weights={"b": 2.0})
    assert order[:6] == ["a-0", "b-0", "b-1", "a-1", "b-2", "b-3"]


@pytest.mark.anyio
async def test_slots_are_counted_per_client_and_forgotten_when_returned() -> None:
    pool = _pool(slots=3)
    first = await pool.acquire("interactive", client="a")
    second = await pool.acquire("interactive", client="a")
    third = await pool.acquire("batch", client="b")
    assert pool.held == {"a": 2, "b": 1}
    assert pool.shares(1) == ([("a", 2)], 1)
    for backend, client in ((first, "a"), (second, "a"), (third, "b")):
        pool.release(backend, client=client)
    assert pool.held == {}


@pytest.mark.anyio
async def test_a_flood_of_distinct_clients_leaves_no_state_behind() -> None:
    """Hostile: ten thousand clients, each its own key, through a full pool's bounded queue. What
    the pool keeps per client is bounded by its slots and queue while they wait, and nothing once
    they have gone; the one well-behaved user is still served next."""
    # No waiter may time out while the flood is sent, however slow the machine: the queue stays full.
    pool = _pool(slots=2, queue_size=64, queue_timeout=3600)
    held = [await pool.acquire("interactive", client=f"flood-{i}") for i in range(2)]
    refused = 0
    waiting: list[asyncio.Task[Backend]] = []
    for number in range(10_000):
        task = asyncio.create_task(pool.acquire("interactive", client=f"flood-{number + 2}"))
        await asyncio.sleep(0)
        if task.done():
            refused += 1  # queue_full: nothing of it is kept
            assert isinstance(task.exception(), NoBackendAvailable)
        else:
            waiting.append(task)
        assert len(pool.held) <= 2 and pool.queued() <= 64
    assert refused == 10_000 - 64
    user = asyncio.create_task(pool.acquire("interactive", client="user"))
    await asyncio.sleep(0)
    assert isinstance(user.exception(), NoBackendAvailable)  # queue_full: the bound holds for everyone
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    pool.release(held[0], client="flood-0")
    pool.release(held[1], client="flood-1")
    assert pool.held == {} and pool.queued() == 0
    assert (await pool.acquire("interactive", client="user")) is held[0]


@pytest.mark.anyio
async def test_the_engine_priority_orders_classes_then_a_clients_other_slots() -> None:
    pool = _pool(slots=8)
    await pool.acquire("interactive", client="a")
    assert pool.priority("interactive", "a", last=False) == 0
    await pool.acquire("interactive", client="a")
    assert pool.priority("interactive", "a", last=False) == 1  # its second: after others' first
    await pool.acquire("batch", client="b")
    assert pool.priority("batch", "b", last=False) == 100
    await pool.acquire("batch", client="c")
    assert pool.priority("batch", "c", last=True) == 200
    for _ in range(150):
        pool.held["a"] = pool.held.get("a", 0) + 1
    assert pool.priority("interactive", "a", last=False) == 99  # never into the next class
