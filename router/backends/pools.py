"""The router's slots on its backends, and each pool's bounded queue.

A request takes a slot with `await pool.acquire(job, client=...)` and gives it back with
`pool.release()`. When every healthy backend is at `max_concurrency`, it waits in the pool's
queue, interactive requests ahead of batch ones, until a slot frees, the queue wait runs out,
or it is cancelled. A queued request is not yet bound to a backend, so the queue belongs to the
pool. Within a class the queue is fair (`fair_share`): a freed slot goes to the waiting request
whose client holds the fewest of the pool's slots for its weight, the earliest first among
equals; so a client with many requests in flight waits behind those with few. The pool counts
slots only for clients holding or waiting for one: its memory is bounded by its slots and queue.
While others are active, a client holding its share waits even for a free slot when taking it
would leave no room for them (router.backends.share). A backend's own state is
router.backends.backend.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from router.backends.backend import Backend
from router.backends.newcomers import Newcomers
from router.backends.share import Activity
from router.clock import Clock, MonotonicClock
from router.config import Fairness, JobClass
from router.config import Health as HealthConfig
from router.config import Pool as PoolConfig
from router.errors import NoBackendAvailable

_EWMA = 0.2  # weight of the newest request duration in the pool's running mean
# Retry-After on the pool's 503s, seconds: a guess from the measured durations, within these.
RETRY_AFTER_FLOOR = 1
RETRY_AFTER_CAP = 60


@dataclass(slots=True, eq=False)
class _Waiter:
    future: asyncio.Future[Backend]
    only: str | None  # the one backend it may take (router.affinity), or any
    client: str  # who sent it (router.routing.clients.client_id)
    weight: float  # its client's share of the slots against others' (fairness.groups)
    order: int  # arrival order in the pool
    tokens: int | None = None  # what it holds of the KV cache at its end, estimated (router.content)
    held_back: bool = False  # it waited for room kept for others (router.backends.share)


class Pool:
    def __init__(
        self,
        name: str,
        *,
        speculative: bool,
        backends: list[Backend],
        queue_size: int,
        queue_timeout: float,
        clock: Clock | None = None,
    ) -> None:
        self.name = name
        self.speculative = speculative
        self.backends = backends
        self.queue_size = queue_size
        self.queue_timeout = queue_timeout
        self._waiters: dict[JobClass, list[_Waiter]] = {"interactive": [], "batch": []}
        self.fair_share = True  # else first come, first served within a class
        self.priority_scheduling = False  # its engines order requests by their `priority` field
        self.held: dict[str, int] = {}  # slots held per client, for those holding one
        self.active = Activity(clock if clock is not None else MonotonicClock())
        self.held_back = 0  # requests that waited for room kept for others, ever
        self.entered: dict[JobClass, int] = {"interactive": 0, "batch": 0}  # requests that joined the queue, ever
        self.newcomers = Newcomers()  # room over the cap for clients holding no slot
        self._recheck: asyncio.TimerHandle | None = None  # a `wake` when the next client goes inactive
        self.mean_duration: float | None = None  # seconds a request takes here, a running mean (None: none yet)

    def queued(self, job: JobClass | None = None) -> int:
        if job is not None:
            return len(self._waiters[job])
        return sum(map(len, self._waiters.values()))

    @property
    def in_flight(self) -> int:
        return sum(backend.in_flight for backend in self.backends)

    @property
    def accepting(self) -> bool:
        return any(backend.accepting for backend in self.backends)

    def _unavailable(self) -> NoBackendAvailable:
        if any(backend.healthy for backend in self.backends):
            why = "is being drained"
        else:
            why = "has no healthy backend" if self.backends else "was removed from the configuration"
        return NoBackendAvailable(f"pool {self.name!r} {why}", retry_after=self._retry_after(), code="pool_unavailable")

    def _unavailable_owner(self, name: str) -> NoBackendAvailable:
        return NoBackendAvailable(
            f"backend {name!r} of pool {self.name!r}, the one that may serve this request, is not accepting",
            retry_after=self._retry_after(),
            code="pool_unavailable",
        )

    async def acquire(
        self,
        job: JobClass,
        *,
        client: str = "",
        weight: float = 1.0,
        exclude: frozenset[str] = frozenset(),
        only: str | None = None,
        prefer: str | None = None,
        tokens: int | None = None,
    ) -> Backend:
        """`client` and `weight`: who asks, for fair share. `exclude`: backends a retry must not
        go back to (none free among the others: fails at once). `only`: the one backend that may
        serve the request (router.affinity); it waits in the queue for a slot there, bounded like
        any other, while the others keep flowing. `prefer`: the backend to take when it has a
        free slot now (its prompt's prefix is cached there, router.conversations); else the
        emptiest. `tokens`: what the request holds of a KV cache at its end, estimated, for room
        over the cap (router.backends.newcomers). Give the slot back with `release(client=...)`."""
        if not self.accepting:
            raise self._unavailable()
        if only is not None:
            owner = next((b for b in self.backends if b.name == only), None)
            if owner is None or not owner.accepting:
                raise self._unavailable_owner(only)
        self.active.seen(client, weight)
        self.active.prune(self.held)
        if (only is not None or not self.queued() or exclude) and (exclude or not self._must_wait(client, weight)):
            # Pinned: a slot free on its backend is one no queued request could take (`wake`).
            backend = self._take(exclude, only, prefer)
            if backend is not None:
                self._hold(client)
                return backend
            if exclude:
                raise NoBackendAvailable(
                    f"pool {self.name!r} has no other backend free",
                    retry_after=self._retry_after(),
                    code="pool_unavailable",
                )
        self.entered[job] += 1
        arrival = sum(self.entered.values())  # its place among all that queued here
        waiter = _Waiter(asyncio.get_running_loop().create_future(), only, client, weight, arrival, tokens)
        queue = self._waiters[job]
        queue.append(waiter)
        # Those ahead may all wait for a full backend of their own: a slot none of them can take
        # is this one's now, not at the next release.
        self.wake()
        if not waiter.future.done() and self.queued() > self.queue_size:
            queue.remove(waiter)
            raise NoBackendAvailable(
                f"pool {self.name!r} is full and its queue holds {self.queue_size} requests",
                retry_after=self._retry_after(),
                code="queue_full",
            )
        try:
            async with asyncio.timeout(self.queue_timeout):
                return await waiter.future
        except BaseException as exc:
            future = waiter.future
            if future.done() and not future.cancelled() and future.exception() is None:
                # A slot was handed over just as we gave up: pass it on.
                self.release(future.result(), client=client)
            else:
                future.cancel()
                if waiter in queue:  # `wake` may have dropped it already
                    queue.remove(waiter)
            if isinstance(exc, TimeoutError):
                where = f"backend {only!r} of pool {self.name!r}" if only is not None else f"pool {self.name!r}"
                raise NoBackendAvailable(
                    f"{where} had no free slot within {self.queue_timeout:g} s",
                    retry_after=self._retry_after(),
                    code="queue_timeout",
                ) from exc
            raise

    def give_back(self, backend: Backend, *, client: str = "") -> None:
        """A slot taken but never used: another replica held the backend's last one."""
        backend.sent -= 1
        self.release(backend, client=client)

    def release(self, backend: Backend, *, client: str = "", duration: float | None = None) -> None:
        backend.in_flight -= 1
        left = self.held.get(client, 0) - 1
        if left > 0:
            self.held[client] = left
        else:
            self.held.pop(client, None)
        self.active.gave_back(client)
        if duration is not None:
            mean = self.mean_duration
            self.mean_duration = duration if mean is None else mean + _EWMA * (duration - mean)
        self.wake()

    def wake(self) -> None:
        """Hand free slots to queued requests (after a release, or a backend turning healthy or
        being drained or resumed); fail at once those with no backend left to wait for.
        Interactive requests go first, then batch; within a class, in fair order (`_rank`). One
        pinned to a backend that is full lets the others take another. Once a request that may
        go anywhere finds no slot, nobody else gets one. A client that must leave room for others
        (`_must_wait`) is passed over, and looked at again when a slot frees or a client goes
        inactive. With every slot taken, an interactive request whose client holds none may go
        over a backend's cap (`newcomers`)."""
        accepting = {b.name for b in self.backends if b.accepting}
        next_inactive = self.active.prune(self.held)
        passed_over = False
        slots = True
        for queue in self._waiters.values():
            waiting = []
            for waiter in queue:
                if waiter.future.done():
                    continue  # cancelled while queued; its request has gone
                if not accepting or (waiter.only is not None and waiter.only not in accepting):
                    failure = self._unavailable() if waiter.only is None else self._unavailable_owner(waiter.only)
                    waiter.future.set_exception(failure)
                    continue
                waiting.append(waiter)
            queue[:] = waiting
            full: set[str] = set()  # backends a pinned request found full: none after it gets them
            waits: set[str] = set()  # clients that must leave the free slots to others
            while slots:
                candidates = [w for w in queue if (w.only is None or w.only not in full) and w.client not in waits]
                if not candidates:
                    break
                waiter = min(candidates, key=self._rank)
                if self._must_wait(waiter.client, waiter.weight):
                    waits.add(waiter.client)
                    for held_back in (w for w in queue if w.client == waiter.client and not w.held_back):
                        held_back.held_back = True
                        self.held_back += 1
                    continue
                backend = self._take(only=waiter.only)
                if backend is None:
                    if waiter.only is None:
                        slots = False  # no slot anywhere
                    else:
                        full.add(waiter.only)
                    continue
                self._hand(queue, waiter, backend)
            if not slots and self.fair_share and queue is self._waiters["interactive"]:
                self._over_cap(queue)
            passed_over = passed_over or bool(waits)
        if self._recheck is not None:
            self._recheck.cancel()
            self._recheck = None
        if passed_over and next_inactive is not None:
            delay = max(0.0, next_inactive - self.active.clock.now())
            self._recheck = asyncio.get_running_loop().call_later(delay, self.wake)

    def _over_cap(self, queue: list[_Waiter]) -> None:
        """Past every slot: a client's first request, in arrival order, over a backend's cap where
        it has room for one (`newcomers`)."""
        now = self.active.clock.now()
        for waiter in list(queue):
            if waiter.client not in self.held:
                backend = self.newcomers.backend(self.backends, now, tokens=waiter.tokens, only=waiter.only)
                if backend is not None:
                    self._hand(queue, waiter, backend)

    def _hand(self, queue: list[_Waiter], waiter: _Waiter, backend: Backend) -> None:
        queue.remove(waiter)
        self._hold(waiter.client)
        waiter.future.set_result(backend)

    def _must_wait(self, client: str, weight: float) -> bool:
        """Whether `client` must leave the free slots to other active clients (`active`)."""
        if not self.fair_share:
            return False
        accepting = [b for b in self.backends if b.accepting]
        free = sum(max(0, b.max_concurrency - b.slots_used) for b in accepting)
        capacity = sum(b.max_concurrency for b in accepting)
        return self.active.must_wait(client, weight, self.held, free=free, capacity=capacity)

    def _rank(self, waiter: _Waiter) -> tuple[float, int]:
        """Fair share: the fewest slots held for the client's weight first, then arrival."""
        if not self.fair_share:
            return (0.0, waiter.order)
        return (self.held.get(waiter.client, 0) / waiter.weight, waiter.order)

    def _hold(self, client: str) -> None:
        self.held[client] = self.held.get(client, 0) + 1

    def priority(self, job: JobClass, client: str, *, last: bool) -> int:
        """The `priority` for a request its client was just given a slot for (lower goes first):
        interactive 0-99, batch 100-199, `last` (a Batch API line, batch work borrowing this pool)
        200-299; within each, the client's other slots here."""
        base = 200 if last else 0 if job == "interactive" else 100
        return base + min(99, max(0, self.held.get(client, 1) - 1))

    def shares(self, top: int) -> tuple[list[tuple[str, int]], int]:
        """The `top` clients by slots held here, most first, and the slots all others hold:
        who has the pool under contention, in a bounded number of rows."""
        ranked = sorted(self.held.items(), key=lambda item: -item[1])
        return ranked[:top], sum(slots for _, slots in ranked[top:])

    def has_other(self, exclude: frozenset[str]) -> bool:
        """Whether a healthy backend not in `exclude` has room now (for a retry)."""
        return any(b.has_room and b.name not in exclude for b in self.backends)

    def _take(
        self, exclude: frozenset[str] = frozenset(), only: str | None = None, prefer: str | None = None
    ) -> Backend | None:
        candidates = [
            b for b in self.backends if b.has_room and b.name not in exclude and (only is None or b.name == only)
        ]
        if not candidates:
            return None
        backend = next((b for b in candidates if b.name == prefer), None) or min(candidates, key=lambda b: b.load)
        backend.in_flight += 1
        backend.sent += 1
        return backend

    def _retry_after(self) -> int:
        """When a slot is likely free for one more request: the queue ahead of it served at the
        pool's measured pace (its running mean duration over its slots). Before anything is
        measured, the floor: a guess would be no better, and a too-long one idles the pool."""
        if self.mean_duration is None:
            return RETRY_AFTER_FLOOR
        # With no backend accepting, the slots it will have once one returns.
        capacity = sum(b.max_concurrency for b in [b for b in self.backends if b.accepting] or self.backends)
        wait = self.mean_duration * (self.queued() + 1) / (capacity or 1)
        return max(RETRY_AFTER_FLOOR, min(RETRY_AFTER_CAP, math.ceil(wait)))


class Pools:
    """Every pool of the router, by name."""

    def __init__(self, *, clock: Clock | None = None) -> None:
        self._pools: dict[str, Pool] = {}
        self._clock = clock if clock is not None else MonotonicClock()

    def configure(
        self, configs: Mapping[str, PoolConfig], health: HealthConfig, fairness: Fairness | None = None
    ) -> set[str]:
        """Take the (re)loaded `pools` and `health` sections. A backend still configured in the same pool with the
        same URL is kept, with its requests in flight, health and readings; others are new.
        Requests running on a backend or pool that is gone finish there; its queue is failed.
        Returns the names of the backends that were not kept (new, gone, or at another URL).
        """
        fairness = fairness if fairness is not None else Fairness()
        before = {backend.name: backend for backend in self.backends()}
        pools: dict[str, Pool] = {}
        for name, config in configs.items():
            old = self._pools.get(name)
            kept = {b.name: b for b in old.backends} if old is not None else {}
            backends = []
            for backend_name, backend_config in config.backends.items():
                if backend_config.discover != "none":
                    # The backends it was found to be (router.backends.discovery), while it names the same.
                    found = [b for b in old.backends if b.found_by == backend_name] if old is not None else []
                    if found and found[0].found_as != (backend_config.url, backend_config.discover):
                        found = []
                    for each in found:
                        each.configure(backend_config)
                        each.outlier.config = health
                    backends += found
                    continue
                backend = kept.get(backend_name)
                if backend is not None and backend.url == backend_config.url:
                    backend.configure(backend_config)
                else:
                    backend = Backend(backend_name, name, backend_config)
                backend.outlier.config = health
                backends.append(backend)
            pool = old or Pool(
                name,
                speculative=config.speculative,
                backends=backends,
                queue_size=config.queue_size,
                queue_timeout=config.queue_timeout,
                clock=self._clock,
            )
            pool.fair_share = fairness.fair_share
            pool.active.keep_room, pool.active.window = fairness.keep_room, fairness.active_window
            pool.priority_scheduling = config.priority_scheduling
            pool.speculative, pool.backends = config.speculative, backends
            pool.queue_size, pool.queue_timeout = config.queue_size, config.queue_timeout
            pools[name] = pool
        gone = [pool for name, pool in self._pools.items() if name not in pools]
        self._pools = pools
        for pool in gone:
            pool.backends = []
        for pool in [*pools.values(), *gone]:
            pool.wake()
        after = {backend.name: backend for backend in self.backends()}
        return {name for name in before.keys() | after.keys() if before.get(name) is not after.get(name)}

    def __getitem__(self, name: str) -> Pool:
        return self._pools[name]

    def get(self, name: str) -> Pool | None:
        return self._pools.get(name)

    def __iter__(self) -> Iterator[Pool]:
        return iter(self._pools.values())

    def backends(self) -> Iterator[Backend]:
        for pool in self:
            yield from pool.backends
