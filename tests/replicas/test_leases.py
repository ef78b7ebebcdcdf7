"""Slots leased ahead of requests (router.replicas.lease), with two replicas on a real Redis:
a request takes a held slot without a round trip, the replicas together never hold more than a
backend's slots, and a replica gives back what it holds idle when the other needs the room."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry

from router.backends.backend import Backend
from router.backends.pools import Pools
from router.clock import MonotonicClock
from router.config import Backend as BackendConfig
from router.config import Classify, Health, Pool, State
from router.metrics import Metrics
from router.replicas.shared import Replicas
from router.routing.clients import Clients
from router.routing.learn import SpeedModel
from router.version import build_info
from tests.redis import RedisServer

pytestmark = [pytest.mark.e2e, pytest.mark.anyio]  # a redis-server of its own

SLOTS = 4


@dataclass
class Replica:
    replicas: Replicas
    clients: Clients
    backend: Backend
    registry: CollectorRegistry

    def round_trips(self, call: str) -> float:
        return self.registry.get_sample_value("specroute_shared_state_seconds_count", {"call": call}) or 0.0

    def held(self) -> int:
        return int(self.replicas.status()["slots_held"].get("b1", 0))

    async def take(self, client: str) -> bool:
        """What the request path does: a slot here first, then its claim across the replicas."""
        self.clients.start(client)
        self.backend.in_flight += 1
        if await self.replicas.claim(self.backend, client):
            return True
        self.backend.in_flight -= 1
        self.clients.finish(client)
        return False

    def end(self, client: str) -> None:
        self.backend.in_flight -= 1
        self.clients.finish(client)
        self.replicas.released(self.backend)
        self.replicas.left(client)


@asynccontextmanager
async def replica(url: str, prefix: str, *, lease_slots: int = 2) -> AsyncIterator[Replica]:
    clock = MonotonicClock()
    pools = Pools()
    backends = {"b1": BackendConfig(url="http://127.0.0.1:9", max_concurrency=SLOTS)}
    pools.configure({"p": Pool(speculative=False, backends=backends)}, Health())
    clients = Clients(clock=clock)
    clients.configure(Classify(burst_hold_seconds=0))
    registry = CollectorRegistry()
    metrics = Metrics(registry, pools, SpeedModel(clock=clock), build=build_info(), clock=clock)
    replicas = Replicas(pools=pools, clients=clients, metrics=metrics, clock=clock)
    state = State(redis_url=url, key_prefix=prefix, timeout=1, sync_interval=0.05, ttl=2, lease_slots=lease_slots)
    replicas.configure(state, stale_after=5, memory=60)
    replicas.open()
    run = asyncio.create_task(replicas.run())
    try:
        await until(lambda: replicas.sharing)
        yield Replica(replicas, clients, next(pools.backends()), registry)
    finally:
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
        await replicas.aclose()


async def until(condition: Callable[[], bool], seconds: float = 10) -> None:
    for _ in range(int(seconds * 100)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not within {seconds} s")


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@asynccontextmanager
async def pair(server: RedisServer, prefix: str, **options: int) -> AsyncIterator[tuple[Replica, Replica]]:
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(replica(server.url, prefix, **options))
        b = await stack.enter_async_context(replica(server.url, prefix, **options))
        await until(lambda: a.replicas.status()["other_replicas"] == 1 == b.replicas.status()["other_replicas"])
        yield a, b


async def test_a_request_takes_a_held_slot_without_a_round_trip(server: RedisServer) -> None:
    async with pair(server, "held") as (a, _):
        assert await a.take("alice")  # the first: claimed in a round trip, and a slot to hold asked for
        assert a.round_trips("claim") == 1
        a.end("alice")
        await until(lambda: a.held() == 2)  # its share of the free room: 4 // 2 replicas
        for _ in range(5):
            assert await a.take("alice")
            a.end("alice")
        assert a.round_trips("claim") == 1  # every later one took a held slot


async def test_the_replicas_together_never_hold_more_than_the_slots(server: RedisServer) -> None:
    async with pair(server, "exact", lease_slots=4) as (a, b):
        for _ in range(5):
            asked = [(one, f"c{n}") for n in range(SLOTS) for one in (a, b)]
            taken = await asyncio.gather(*(one.take(client) for one, client in asked))
            assert sum(taken) <= SLOTS
            await asyncio.sleep(0.1)  # slots held, given back and asked for behind the requests
            # What each has in use and holds idle, within the slots together.
            assert a.backend.in_flight + a.held() + b.backend.in_flight + b.held() <= SLOTS
            for (one, client), ok in zip(asked, taken, strict=True):
                if ok:
                    one.end(client)


async def test_an_idle_replica_gives_back_the_room_the_other_needs(server: RedisServer) -> None:
    async with pair(server, "idle") as (a, b):
        assert await b.take("bob")
        b.end("bob")
        await until(lambda: b.held() == 2)  # 4 free, two replicas: it holds 2 idle
        taken = [await a.take("etl") for _ in range(SLOTS)]
        assert taken.count(True) == 2  # the other two are b's
        # b's share of what is free shrinks as a fills the backend: it gives its two back, one
        # at a sync, and a takes each in turn.
        for _ in range(2):
            for _ in range(500):
                if await a.take("etl"):
                    break
                await asyncio.sleep(0.01)
        assert a.backend.in_flight == SLOTS and b.held() == 0
        assert not await a.take("etl")


async def test_without_leases_every_request_claims_in_a_round_trip(server: RedisServer) -> None:
    async with pair(server, "none", lease_slots=0) as (a, _):
        for _ in range(3):
            assert await a.take("alice")
            a.end("alice")
        await asyncio.sleep(0.1)
        assert a.round_trips("claim") == 3 and a.held() == 0
