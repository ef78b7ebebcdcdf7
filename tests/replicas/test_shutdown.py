"""The replicas' syncs end when the router stops, even when the store's client library turns the
cancellation into an error of its own (which the syncs survive by design)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

import pytest
from prometheus_client import CollectorRegistry

from router.backends.engines import Elsewhere
from router.backends.pools import Pools
from router.clock import MonotonicClock
from router.config import Backend as BackendConfig
from router.config import Health, Pool, State
from router.metrics import Metrics
from router.replicas.shared import Replicas
from router.replicas.store import Ask, Claims, ClientShare, StoreError, View
from router.routing.clients import Clients
from router.routing.learn import SpeedModel
from router.version import build_info

pytestmark = pytest.mark.anyio


class Swallowing:
    """A store whose every sync waits, and answers a cancellation with its own error."""

    def __init__(self) -> None:
        self.syncs = 0
        self.waiting = asyncio.Event()

    async def sync(
        self, clients: Mapping[str, int], backends: Mapping[str, Elsewhere], held: Mapping[str, int] | None = None
    ) -> View:
        self.syncs += 1
        if self.syncs == 1:
            return View(1, {})
        self.waiting.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise StoreError("connection closed while reading") from None
        finally:
            self.waiting.clear()
        raise AssertionError("unreachable")

    async def client(self, client: str, *, here: int) -> ClientShare:
        raise StoreError("not asked here")

    async def claim(self, asks: Sequence[Ask]) -> Claims:
        raise StoreError("not asked here")

    async def ended(
        self,
        clients: Mapping[str, int],
        backends: Mapping[str, int],
        unread: Mapping[str, int],
        held: Mapping[str, int] | None = None,
    ) -> None:
        return None

    async def aclose(self) -> None:
        return None


async def test_a_cancellation_the_store_swallows_still_ends_the_syncs() -> None:
    clock = MonotonicClock()
    pools = Pools()
    pools.configure({"p": Pool(speculative=False, backends={"b1": BackendConfig(url="http://127.0.0.1:9")})}, Health())
    clients = Clients(clock=clock)
    metrics = Metrics(CollectorRegistry(), pools, SpeedModel(clock=clock), build=build_info(), clock=clock)
    replicas = Replicas(pools=pools, clients=clients, metrics=metrics, clock=clock)
    replicas.configure(State(redis_url="redis://127.0.0.1:9", sync_interval=0.05, timeout=1), stale_after=5, memory=60)
    store = Swallowing()
    replicas.open(store)
    run = asyncio.create_task(replicas.run())
    for _ in range(500):
        if store.syncs >= 3:  # joined, then syncs that wait out their time: the loop goes on
            break
        await asyncio.sleep(0.01)
    assert store.syncs >= 3
    await asyncio.wait_for(store.waiting.wait(), 5)
    run.cancel()  # lands in a sync: the store answers it with its StoreError
    done, _ = await asyncio.wait({run}, timeout=5)
    assert run in done and run.cancelled()
