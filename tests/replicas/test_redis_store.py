"""`RedisStore` against a real Redis: what two replicas see of each other, claims that are atomic
across them, figures that expire with a replica that stopped, and peaks kept within a bound."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest
import redis as redis_sync

from router.backends.engines import Elsewhere
from router.replicas.redis import RedisStore
from tests.redis import RedisServer

pytestmark = [pytest.mark.e2e, pytest.mark.anyio]  # a redis-server of its own


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture
def keys(server: RedisServer, request: pytest.FixtureRequest) -> str:
    """A key prefix of the test's own: tests share the server, never their keys."""
    return str(request.node.name)[:60]


def _store(server: RedisServer, keys: str, replica: str, **options: float) -> RedisStore:
    settings: dict[str, float] = {"ttl": 5.0, "memory": 60.0, "max_clients": 1000} | options
    return RedisStore(
        server.url,
        replica=replica,
        key_prefix=keys,
        ttl=settings["ttl"],
        memory=settings["memory"],
        max_clients=int(settings["max_clients"]),
        max_connections=8,
        socket_timeout=2.0,
    )


@pytest.fixture
async def pair(server: RedisServer, keys: str) -> AsyncIterator[tuple[RedisStore, RedisStore]]:
    a, b = _store(server, keys, "a"), _store(server, keys, "b")
    for store in (a, b):
        await store.sync({}, {})  # both live
    yield a, b
    await a.aclose()
    await b.aclose()


async def test_each_replica_sees_the_others_requests_of_a_client(pair: tuple[RedisStore, RedisStore]) -> None:
    a, b = pair
    for _ in range(3):
        seen = await a.client("etl", new=1)
    assert seen.in_flight == 0 and seen.peak == 3
    for expected in (3, 3):
        seen = await b.client("etl", new=1)
        assert seen.in_flight == expected  # a's three, whatever b has
    assert seen.peak == 5
    again = await b.client("etl", new=0)  # looked at again: not counted twice
    assert again.in_flight == 3 and again.peak == 5
    await a.ended({"etl": 3}, {}, {})
    assert (await b.client("etl", new=0)).in_flight == 0
    assert (await b.client("other", new=0)).in_flight == 0


async def test_a_backends_last_slot_goes_to_one_replica(pair: tuple[RedisStore, RedisStore]) -> None:
    a, b = pair
    claims = await asyncio.gather(*(store.claim("team-1", unread=1, limit=3) for _ in range(10) for store in (a, b)))
    assert sum(claim.granted for claim in claims) == 3
    # What each replica holds shows to the other, with what it sent since its reading.
    held_by_a = sum(claim.granted for claim in claims[0::2])
    seen = await b.claim("team-1", unread=0, limit=3)
    assert not seen.granted and seen.elsewhere == Elsewhere(held_by_a, 1 if held_by_a else 0)
    await a.ended({}, {"team-1": held_by_a}, {"team-1": 0})
    assert (await b.client("x", new=0)).backends.get("team-1", Elsewhere()) == Elsewhere(0, 0)


async def test_a_sync_replaces_what_a_replica_had(pair: tuple[RedisStore, RedisStore]) -> None:
    a, b = pair
    await a.client("etl", new=1)
    await a.claim("fast-1", unread=1, limit=10)
    view = await a.sync({"dev": 2}, {"team-1": Elsewhere(4, 2)})
    assert view.replicas == 1  # b
    seen = await b.client("etl", new=0)
    assert seen.in_flight == 0  # a's count of etl went with the sync
    assert seen.backends == {"team-1": Elsewhere(4, 2)}
    assert (await b.client("dev", new=0)).in_flight == 2


async def test_a_replica_that_stopped_ages_out(server: RedisServer, keys: str) -> None:
    a, gone = _store(server, keys, "a", ttl=0.3), _store(server, keys, "gone", ttl=0.3)
    try:
        await gone.sync({"etl": 5}, {"team-1": Elsewhere(2, 1)})
        view = await a.sync({}, {})
        assert view.replicas == 1 and view.backends == {"team-1": Elsewhere(2, 1)}
        await asyncio.sleep(0.4)  # Redis's own clock: the stopped replica's figures expire past its ttl
        view = await a.sync({}, {})
        assert view.replicas == 0 and view.backends == {}
        assert (await a.client("etl", new=0)).in_flight == 0
        client = redis_sync.Redis.from_url(server.url)
        assert not client.exists(f"{{{keys}}}:r:gone:c", f"{{{keys}}}:r:gone:b", f"{{{keys}}}:r:gone:u")
        client.close()
    finally:
        await a.aclose()
        await gone.aclose()


async def test_a_flood_of_clients_keeps_the_peaks_bounded(server: RedisServer, keys: str) -> None:
    store = _store(server, keys, "a", max_clients=50)
    try:
        await store.sync({}, {})
        for n in range(400):
            await store.client(f"flood-{n}", new=1)
        client = redis_sync.Redis.from_url(server.url)
        assert client.hlen(f"{{{keys}}}:peaks") <= 50
        assert client.zcard(f"{{{keys}}}:fades") <= 50
        assert client.pttl(f"{{{keys}}}:peaks") > 0  # and it all expires when no replica writes
        client.close()
        assert (await store.client("flood-399", new=0)).peak == 1  # the newest is kept
    finally:
        await store.aclose()


async def test_a_peak_fades_by_redis_clock(server: RedisServer, keys: str) -> None:
    store = _store(server, keys, "a", memory=0.2)
    try:
        await store.sync({}, {})
        for _ in range(8):
            await store.client("etl", new=1)
        await store.ended({"etl": 8}, {}, {})
        await asyncio.sleep(0.25)
        peak = (await store.client("etl", new=0)).peak
        assert 1.5 < peak < 4.5  # halved once or a little more, 8 → about 4
    finally:
        await store.aclose()
