"""`Replicas`: what a router asks of the state it shares with its replicas, never waiting long.

Alone (no `state.redis_url`), every call returns at once and the router decides from its own
view, as a single router does. With a store, a request usually takes a slot this replica holds
already (router.replicas.lease) and asks nothing on its way. Else it makes one call, when it
takes a slot: granted only if the replicas together stay within the backend's
`max_concurrency`, it writes the client's requests here and answers its figures and every
backend's from the others, which the next requests are classified by. Only a client not seen
lately is looked up before it is classified (`arrived`). Claims asked for while one is under way
go together in the next round trip; each caller waits within `state.timeout`. Behind the
requests, gathered over a few milliseconds: the slots to hold claimed again (each carrying the
count of a client that took one, and answering its figures), what ended written; and everything
written whole every `state.sync_interval`, which repairs any write lost or late.

A call that fails or runs out of time turns the replica to its own view: logged once, shown in
`/readyz` and in `specroute_shared_state_up`. It rejoins at the first sync that succeeds.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import secrets
import socket
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from router.backends.backend import Backend
from router.backends.engines import ALONE, Elsewhere
from router.backends.pools import Pools
from router.clock import Clock
from router.config import State
from router.metrics import Metrics
from router.replicas.coalesce import Coalesced
from router.replicas.lease import Leases
from router.replicas.store import Ask, Claim, Store, StoreError
from router.routing.clients import Clients

logger = logging.getLogger("specroute.replicas")

_T = TypeVar("_T")

_GATHER = 0.01  # seconds over which what ended is gathered into one write behind the requests


def replica_id() -> str:
    """This process among the replicas: its host, its pid, and a random part (a restarted
    process is another replica: the old one's figures expire on their own)."""
    return f"{socket.gethostname()[:64]}:{os.getpid()}:{secrets.token_hex(4)}"


def client_key(client: str) -> str:
    """A client's id as the store holds it: bounded, and never its API key in the clear."""
    return hashlib.blake2b(client.encode(), digest_size=12).hexdigest()


class Replicas:
    def __init__(self, *, pools: Pools, clients: Clients, metrics: Metrics, clock: Clock) -> None:
        self._pools = pools
        self._clients = clients
        self._metrics = metrics
        self._clock = clock
        self._config = State()
        self._stale_after = 5.0
        self._memory = 0.0
        self.replica = replica_id()
        self._store: Store | None = None
        self.sharing = False  # the store answered its last call
        self._since = clock.now()  # when `sharing` last changed
        self._last_error: str | None = None
        self._others = 0  # live replicas besides this one, at the last sync
        # Clients whose requests ended (by their key in the store), and slots ended per backend,
        # since last written: written behind the requests.
        self._left: dict[str, str] = {}
        self._ended_backends: Counter[str] = Counter()  # less those taken from the held ones
        self._held_change: Counter[str] = Counter()  # slots held (router.replicas.lease): taken, kept, given back
        self._claims: Coalesced[Ask, Claim] = Coalesced(self._claim_round)
        self._leases = Leases(size=0, idle=0)
        self._changed = asyncio.Event()
        # Clear while a sync is under way: a count sent meanwhile could land before the sync's
        # whole figures, which were taken without it, and be overwritten. And the sync waits for
        # the calls under way (`_calls`): a slot being claimed is not yet one this replica holds.
        self._between_syncs = asyncio.Event()
        self._between_syncs.set()
        self._calls = 0
        self._no_calls = asyncio.Event()
        self._no_calls.set()

    def configure(self, config: State, *, stale_after: float, memory: float) -> None:
        """`state` (read at start: the store is opened once), the scrape's `stale_after` and
        classify's `client_memory_seconds`."""
        self._config, self._stale_after, self._memory = config, stale_after, memory
        self._leases = Leases(size=config.lease_slots, idle=config.ttl)

    def open(self, store: Store | None = None) -> None:
        """Open the configured store (or `store`, another mechanism); the first sync joins it."""
        config = self._config
        if store is None and config.redis_url is not None:
            from router.replicas.redis import RedisStore  # the `redis` extra, only when configured

            store = RedisStore(
                config.redis_url,
                replica=self.replica,
                key_prefix=config.key_prefix,
                ttl=config.ttl,
                memory=self._memory,
                max_clients=config.max_clients,
                max_connections=config.max_connections,
                socket_timeout=max(config.sync_interval, config.timeout),
            )
        self._store = store
        self._last_error = "not joined yet" if store is not None else None

    async def aclose(self) -> None:
        await self._claims.aclose()
        if self._store is not None:
            await self._store.aclose()

    def status(self) -> dict[str, Any]:
        """For `/readyz`: whether the replica shares its state now, and since when."""
        if self._store is None:
            return {"store": "none", "sharing": False}
        return {
            "store": "redis" if self._config.redis_url else "workers",
            "sharing": self.sharing,
            "since_seconds": round(self._clock.now() - self._since, 3),
            "other_replicas": self._others if self.sharing else None,
            "last_error": self._last_error,
            "slots_held": self._leases.holding(),  # router.replicas.lease
        }

    # The request path.

    async def arrived(self, client: str) -> None:
        """Before classifying a request of a client not seen lately (counted here already, by
        router.routing.clients): write its count here, and learn what the other replicas have of
        it and of every backend."""
        store = self._store
        if store is None or not self.sharing:
            return
        here = self._clients[client]
        share = await self._call("client", lambda: store.client(client_key(client), here=here))
        if share is not None:
            self._clients.share(client, elsewhere=share.in_flight, peak=share.peak)
            self._apply(share.backends)

    def left(self, client: str) -> None:
        if self.sharing:
            self._left[client_key(client)] = client
            self._changed.set()

    async def claim(self, backend: Backend, client: str) -> bool:
        """Whether the slot this router just took on `backend` for a request of `client` is free
        across the replicas. Alone, or with the store failing, it is."""
        if self._store is None or not self.sharing:
            return True
        if self._leases.take(backend.name, self._clock.now()):
            # Written behind it: the slot in use, no longer held, and its client's count.
            self._ended_backends[backend.name] -= 1
            self._held_change[backend.name] -= 1
            self._left[client_key(client)] = client
            self._changed.set()
            return True
        claim = await self._call("claim", lambda: self._claims(self._ask(backend, client)))
        if claim is None:
            return True
        self._clients.share(client, elsewhere=claim.in_flight, peak=claim.peak)
        if claim.granted:
            return True
        # Refused: no room here until the next view of the others (a sync, another claim),
        # however few the others hold: this replica's own count there may not have caught up
        # with what ended here yet, and a request asking again at once would only be refused again.
        full = backend.max_concurrency - (backend.in_flight - 1)
        backend.elsewhere = Elsewhere(max(backend.elsewhere.in_flight, full), backend.elsewhere.unread)
        return False

    def _ask(self, backend: Backend, client: str | None, *, hold: bool = False) -> Ask:
        """A slot on `backend` (in use, or to `hold`), carrying `client`'s count (or none)."""
        unread = backend.unread(self._clock.now(), self._stale_after)
        key, here = (client_key(client), self._clients[client]) if client is not None else ("", 0)
        return Ask(backend.name, unread, backend.max_concurrency, key, here, hold)

    async def _claim_round(self, asks: Sequence[Ask]) -> Sequence[Claim]:
        """One round trip for the claims asked for meanwhile (router.replicas.coalesce)."""
        assert self._store is not None
        answer = await self._store.claim(asks)
        if self.sharing:  # not if a caller ran out of time meanwhile
            self._apply(answer.backends)
        return answer.claims

    def released(self, backend: Backend) -> None:
        """A slot on `backend` that `claim` granted ended."""
        if self.sharing:
            self._ended_backends[backend.name] += 1
            if self._leases.keep(backend.name):
                self._held_change[backend.name] += 1
            self._changed.set()

    async def _call(self, what: str, call: Callable[[], Awaitable[_T]]) -> _T | None:
        started = self._clock.now()
        try:
            async with asyncio.timeout(self._config.timeout):
                await self._between_syncs.wait()
                self._calls += 1
                self._no_calls.clear()
                try:
                    result = await call()
                finally:
                    self._calls -= 1
                    if not self._calls:
                        self._no_calls.set()
        except TimeoutError:
            self._alone(f"no answer within {self._config.timeout:g} s ({what})")
            return None
        except StoreError as exc:
            self._alone(f"{exc} ({what})")
            return None
        self._metrics.shared_state_seconds.labels(what).observe(self._clock.now() - started)
        return result

    # Behind the requests.

    async def run(self) -> None:
        """Sync every `sync_interval`; between syncs, write what ended as it ends."""
        if self._store is None:
            return
        while True:
            _stop_if_cancelled()
            try:
                await self._sync()
                due = self._clock.now() + self._config.sync_interval
                while (left := due - self._clock.now()) > 0:
                    _stop_if_cancelled()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(left):
                            await self._changed.wait()
                            # What else changes meanwhile goes in the same writes, which leave
                            # the requests under way the event loop's time to themselves.
                            await asyncio.sleep(min(_GATHER, left))
                    self._changed.clear()
                    if self.sharing:
                        await self._lease()
                    if self.sharing and (self._left or self._ended_backends or self._held_change):
                        await self._ended()
            except Exception as exc:
                # A bug of ours or of a store: never the end of the syncs, which a queue waiting
                # for another replica's slot depends on.
                logger.exception("shared state: sync failed")
                self._alone(f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(self._config.sync_interval)

    async def _lease(self) -> None:
        """Claim the slots to hold (router.replicas.lease), each carrying the count of a client
        whose request took one held, and folding its figures in as a request's claim does."""
        backends = {b.name: b for b in self._pools.backends()}
        asks, clients = [], []
        for name, want in self._leases.wanted().items():
            for _ in range(want if name in backends else 0):
                client = self._left.popitem()[1] if self._left else None
                asks.append(self._ask(backends[name], client, hold=True))
                clients.append(client)
        if not asks:
            return
        claims = await self._call("lease", lambda: asyncio.gather(*(self._claims(ask) for ask in asks)))
        for ask, client, claim in zip(asks, clients, claims or (), strict=False):
            if client is not None:
                self._clients.share(client, elsewhere=claim.in_flight, peak=claim.peak)
            if claim.granted and self.sharing:
                self._leases.granted(ask.backend)

    async def _ended(self) -> None:
        assert self._store is not None
        left, self._left = self._left, {}
        clients = {key: self._clients[client] for key, client in left.items()}
        backends, self._ended_backends = self._ended_backends, Counter()
        held, self._held_change = self._held_change, Counter()
        now = self._clock.now()
        unread = {b.name: b.unread(now, self._stale_after) for b in self._pools.backends() if b.name in backends}
        try:
            async with asyncio.timeout(self._config.sync_interval):
                await self._store.ended(clients, backends, unread, held)
        except (TimeoutError, StoreError) as exc:
            self._alone(str(exc) or "no answer to a write")

    async def _sync(self) -> None:
        assert self._store is not None
        self._between_syncs.clear()
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._config.timeout):  # each call is bounded by it
                    await self._no_calls.wait()
            now = self._clock.now()
            clients = {client_key(c): n for c, n in self._clients.counts().items()}
            backends = {b.name: self._own(b, now) for b in self._pools.backends() if b.in_flight}
            held = self._leases.holding()
            self._left, self._ended_backends, self._held_change = {}, Counter(), Counter()  # in the counts above
            async with asyncio.timeout(self._config.sync_interval):
                view = await self._store.sync(clients, backends, held)
        except (TimeoutError, StoreError) as exc:
            self._alone(str(exc) or f"no answer to a sync within {self._config.sync_interval:g} s")
            return
        finally:
            self._between_syncs.set()
        self._others = view.replicas
        if not self.sharing:
            self.sharing, self._since, self._last_error = True, self._clock.now(), None
            self._metrics.shared_state_up.set(1)
            logger.info("shared state: joined the other replicas (%d live)", view.replicas)
        self._apply(view.backends)

    def _own(self, backend: Backend, now: float) -> Elsewhere:
        return Elsewhere(backend.in_flight, backend.unread(now, self._stale_after))

    def _apply(self, backends: Mapping[str, Elsewhere]) -> None:
        for backend in self._pools.backends():
            backend.elsewhere = backends.get(backend.name, ALONE)
        back = self._leases.rebalance(self._pools.backends(), self._others, self._clock.now())
        if back or self._leases.wanted():
            self._held_change.subtract(back)
            self._changed.set()
        for pool in self._pools:
            pool.wake()  # a slot another replica freed may be this one's queue's now

    def _alone(self, why: str) -> None:
        """The store failed: decide from this replica's own view until a sync succeeds."""
        self._last_error = why
        if not self.sharing:
            return
        self.sharing, self._since = False, self._clock.now()
        self._metrics.shared_state_up.set(0)
        self._metrics.shared_state_fallbacks.inc()
        logger.warning("shared state: deciding alone from now on, until the store answers again: %s", why)
        self._clients.alone()
        self._leases.clear()
        for backend in self._pools.backends():
            backend.elsewhere = ALONE
        for pool in self._pools:
            pool.wake()


def _stop_if_cancelled() -> None:
    """End `run` if it was asked to, even where something below turned the cancellation into an
    error of its own (a store's client library), which `run` survives by design: the task is
    still `cancelling()`. Else the router's shutdown waited on it forever."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
