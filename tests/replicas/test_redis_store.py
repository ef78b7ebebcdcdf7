"""`RedisStore` against a real Redis: what two replicas see of each other, claims that are atomic
across them, figures that expire with a replica that stopped, and peaks kept within a bound."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest
import redis as redis_sync

from router.backends.engines import Elsewhere
from router.replicas.redis import RedisStore
from router.replicas.store import Ask
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
    seen = await a.client("etl", here=3)
    assert seen.in_flight == 0 and seen.peak == 3
    seen = await b.client("etl", here=2)
    assert seen.in_flight == 3 and seen.peak == 5
    again = await b.client("etl", here=2)  # a count written whole: never counted twice
    assert again.in_flight == 3 and again.peak == 5
    await a.ended({"etl": 0}, {}, {})
    assert (await b.client("etl", here=2)).in_flight == 0
    assert (await b.client("other", here=0)).in_flight == 0


async def test_a_backends_last_slot_goes_to_one_replica(pair: tuple[RedisStore, RedisStore]) -> None:
    a, b = pair
    asked = [store.claim([Ask("team-1", 1, 3, "etl", 1)]) for _ in range(10) for store in (a, b)]
    granted = [answer.claims[0].granted for answer in await asyncio.gather(*asked)]
    assert sum(granted) == 3
    # What each replica holds shows to the other, with what it sent since its reading.
    held_by_a = sum(granted[0::2])
    seen = await b.claim([Ask("team-1", 0, 3, "etl", 1)])
    assert not seen.claims[0].granted
    assert seen.backends.get("team-1", Elsewhere()) == Elsewhere(held_by_a, 1 if held_by_a else 0)
    await a.ended({}, {"team-1": held_by_a}, {"team-1": 0})
    assert (await b.client("x", here=0)).backends.get("team-1", Elsewhere()) == Elsewhere(0, 0)


async def test_claims_in_one_round_are_granted_in_order_within_the_limit(pair: tuple[RedisStore, RedisStore]) -> None:
    a, b = pair
    await b.client("etl", here=2)
    answer = await a.claim([Ask("team-1", unread, 3, "etl", 4) for unread in range(5)])
    assert [claim.granted for claim in answer.claims] == [True, True, True, False, False]
    assert all(claim.in_flight == 2 and claim.peak == 6 for claim in answer.claims)  # b's two, and a's four
    seen = await b.claim([Ask("team-1", 0, 3, "dev", 1)])
    assert not seen.claims[0].granted and seen.backends == {"team-1": Elsewhere(3, 2)}
    assert (await b.client("etl", here=2)).in_flight == 4  # the claims wrote a's count of etl


async def test_a_sync_replaces_what_a_replica_had(pair: tuple[RedisStore, RedisStore]) -> None:
    a, b = pair
    await a.client("etl", here=1)
    await a.claim([Ask("fast-1", 1, 10, "etl", 1)])
    view = await a.sync({"dev": 2}, {"team-1": Elsewhere(4, 2)})
    assert view.replicas == 1  # b
    seen = await b.client("etl", here=0)
    assert seen.in_flight == 0  # a's count of etl went with the sync
    assert seen.backends == {"team-1": Elsewhere(4, 2)}
    assert (await b.client("dev", here=0)).in_flight == 2


async def test_a_replica_that_stopped_ages_out(server: RedisServer, keys: str) -> None:
    a, gone = _store(server, keys, "a", ttl=0.3), _store(server, keys, "gone", ttl=0.3)
    try:
        await gone.sync({"etl": 5}, {"team-1": Elsewhere(2, 1)})
        view = await a.sync({}, {})
        assert view.replicas == 1 and view.backends == {"team-1": Elsewhere(2, 1)}
        await asyncio.sleep(0.4)  # Redis's own clock: the stopped replica's figures expire past its ttl
        view = await a.sync({}, {})
        assert view.replicas == 0 and view.backends == {}
        assert (await a.client("etl", here=0)).in_flight == 0
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
            await store.client(f"flood-{n}", here=1)
        client = redis_sync.Redis.from_url(server.url)
        assert client.hlen(f"{{{keys}}}:peaks") <= 50
        assert client.zcard(f"{{{keys}}}:fades") <= 50
        assert client.pttl(f"{{{keys}}}:peaks") > 0  # and it all expires when no replica writes
        client.close()
        assert (await store.client("flood-399", here=0)).peak == 1  # the newest is kept
    finally:
        await store.aclose()


async def test_a_peak_fades_by_redis_clock(server: RedisServer, keys: str) -> None:
    store = _store(server, keys, "a", memory=0.2)
    try:
        await store.sync({}, {})
        await store.client("etl", here=8)
        await store.ended({"etl": 0}, {}, {})
        await asyncio.sleep(0.25)
        peak = (await store.client("etl", here=0)).peak
        assert 1.5 < peak < 4.5  # halved once or a little more, 8 → about 4
    finally:
        await store.aclose()


async def test_slots_held_count_against_the_limit_not_as_in_use(pair: tuple[RedisStore, RedisStore]) -> None:
    a, b = pair
    held = await a.claim([Ask("team-1", 0, 3, "", 0, hold=True), Ask("team-1", 0, 3, "", 0, hold=True)])
    assert [claim.granted for claim in held.claims] == [True, True]
    seen = await b.claim([Ask("team-1", 0, 3, "dev", 1), Ask("team-1", 0, 3, "dev", 1)])
    assert [claim.granted for claim in seen.claims] == [True, False]  # a holds two of the three
    assert (await a.client("x", here=0)).backends == {"team-1": Elsewhere(1, 0)}  # b's one in use
    assert (await b.client("x", here=0)).backends["team-1"] == Elsewhere(0, 0)  # a holds two, uses none
    await a.ended({}, {"team-1": -1}, {"team-1": 1}, {"team-1": -1})  # one held taken by a request
    assert (await b.client("x", here=0)).backends == {"team-1": Elsewhere(1, 1)}
    await a.ended({}, {}, {}, {"team-1": -1})  # the other given back: b's second claim fits
    assert (await b.claim([Ask("team-1", 0, 3, "dev", 2)])).claims[0].granted
