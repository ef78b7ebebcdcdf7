"""Live pool state: backends with their requests in flight, and each pool's bounded queue.

A request takes a slot with `await pool.acquire(job)` and gives it back with `pool.release()`.
When every healthy backend is at `max_concurrency`, it waits in the pool's queue, interactive
requests ahead of batch ones, until a slot frees, the queue wait runs out, or it is cancelled.
A queued request is not yet bound to a backend, so the queue belongs to the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Iterator

from router.config import Backend as BackendConfig
from router.config import Health as HealthConfig
from router.config import JobClass, Settings
from router.content import CONTENT_KINDS
from router.errors import NoBackendAvailable
from router.learn import SpeedModel
from router.policy import PoolState
from router.scrape import EngineLoad

_EWMA = 0.2  # weight of the newest request duration in the pool's running mean

# One line each time a backend is taken out or comes back, with why.
state_log = logging.getLogger("specroute.backends")


class Backend:
    def __init__(self, name: str, pool: str, config: BackendConfig) -> None:
        self.name = name
        self.pool = pool
        self.url = config.url
        self.api_key = config.api_key()
        self.max_concurrency = config.max_concurrency
        self.in_flight = 0
        self.healthy = True
        self.draining = False  # set by an operator: no new work, running requests finish
        self.engine = EngineLoad()  # the latest scrape of its /metrics
        self.scrape_stale = False  # its readings went stale (logged once; fresh again logs again)
        self._kv_per_request: float | None = None  # KV usage per running request, as last seen
        # What the engine states of its capacity (vLLM's cache_config_info): requests that fit.
        self.stated_concurrency: float | None = None
        # The last speculative acceptance measured: (acceptance, accept length, when), monotonic.
        self.acceptance: tuple[float, float | None, float] | None = None
        self._probes_failed = self._probes_passed = 0  # in a row
        self._requests_failed = 0  # in a row
        self.ejections = 0  # in a row, without a success between
        self.ejected_for = 0.0  # seconds, the latest ejection
        self.ejected_until = 0.0
        self.recent_ttft: deque[float] = deque(maxlen=256)
        # Streams sent here that have no first token yet: a token of each -> when it was sent.
        self._awaiting_first: dict[object, float] = {}

    def configure(self, config: BackendConfig) -> None:
        """A reloaded configuration for the same backend (same name and URL)."""
        self.api_key = config.api_key()
        self.max_concurrency = config.max_concurrency

    @property
    def accepting(self) -> bool:
        """Whether new work may go here: healthy and not being drained."""
        return self.healthy and not self.draining

    @property
    def kv_per_request(self) -> float:
        """KV usage one request takes: as last seen with requests running; before that, the prior
        of the capacity the engine states and the configured `max_concurrency`, whichever is less.
        So a burst on a router that has not yet seen the engine loaded still projects it full."""
        if self._kv_per_request is not None:
            return self._kv_per_request
        slots = min(self.max_concurrency, self.stated_concurrency or math.inf)
        return 1.0 / max(1.0, slots)

    def kv_projected(self, now: float, stale_after: float) -> float | None:
        """The engine's KV usage once one more request is sent: the last reading, plus what each
        request sent since (and the next one) will take, at the usage per running request.

        A reading lags by a scrape; users arriving faster than that would otherwise overfill a
        speculative engine's cache before the router sees it fill. Without a fresh reading, the
        router's own requests at that usage each.
        """
        engine = self.engine
        if engine.kv_usage is None:
            return None  # the engine says nothing of its KV cache
        if not engine.fresh(now, stale_after):
            # Scrapes are failing (the engine, or this router, too busy to answer in time): what
            # this router's own requests take, so that missed scrapes do not open the gate.
            return self.kv_per_request * (self.in_flight + 1)
        sent_since = max(0, self.in_flight - engine.own_in_flight)
        return engine.kv_usage + self.kv_per_request * (sent_since + 1)

    def observe(self, engine: EngineLoad) -> None:
        """A new reading of the engine's own metrics. The KV per request is kept from the last
        reading that had requests running, and the acceptance from the last that had drafts, so
        an idle engine still has both."""
        self.engine = engine
        if engine.running and engine.kv_usage is not None:
            self._kv_per_request = engine.kv_usage / engine.running
        if engine.max_concurrency:
            self.stated_concurrency = engine.max_concurrency
        if engine.acceptance is not None:
            self.acceptance = (engine.acceptance, engine.accept_length, engine.scraped_at)

    def accept_length(self, now: float, max_age: float) -> float | None:
        """Tokens a sequence gains per step, as last measured, if not older than `max_age`."""
        if self.acceptance is None or now - self.acceptance[2] > max_age:
            return None
        return self.acceptance[1]

    def has_engine_room(self, now: float, stale_after: float, kv_threshold: float) -> bool:
        """Whether the engine's last fresh reading shows a free slot and KV headroom for one more.
        Requests it reports waiting meanwhile are passing through, not a queue."""
        engine = self.engine
        if not engine.fresh(now, stale_after):
            return False
        if engine.running is not None and engine.running >= self.max_concurrency:
            return False
        return engine.kv_usage is None or engine.kv_usage + self.kv_per_request < kv_threshold

    def concurrency(self, now: float, stale_after: float) -> int:
        """Requests on the engine: what it reported, plus what this router sent it since.

        The engine's figure includes other clients and other routers, but lags by a scrape;
        the router's own count is exact but sees only itself. Never less than the latter.
        """
        engine = self.engine
        if not engine.fresh(now, stale_after) or engine.running is None:
            return self.in_flight
        reported = engine.running + (engine.waiting or 0)
        return max(self.in_flight, round(reported) + max(0, self.in_flight - engine.own_in_flight))

    def await_first_token(self, token: object, now: float) -> None:
        self._awaiting_first[token] = now

    def first_token(self, token: object, ttft: float) -> None:
        """A stream's first token arrived (`ttft` seconds after it reached the router)."""
        if self._awaiting_first.pop(token, None) is not None:
            self.recent_ttft.append(ttft)

    def forget_first_token(self, token: object) -> None:
        self._awaiting_first.pop(token, None)

    def oldest_waiting_first_token(self, now: float) -> float:
        """Seconds the oldest stream sent here has waited without a first token (0: none waits)."""
        return now - min(self._awaiting_first.values()) if self._awaiting_first else 0.0

    def predicted_ttft(self, now: float, *, queued: int, kv_threshold: float, stale_after: float, mean: float) -> float:
        """The first-token wait of one more request here, predicted.

        The recent first tokens (median of the last few) and the oldest stream still waiting for
        one are what it takes now; if the request would wait for a slot (the engine has requests
        waiting, no KV headroom or no free slot, or the router's queue is not empty), one running
        request must finish per request ahead of it, at the mean request duration over the
        requests running.
        """
        recent = sorted(list(self.recent_ttft)[-8:])
        base = max(recent[len(recent) // 2] if recent else 0.0, self.oldest_waiting_first_token(now))
        engine = self.engine
        fresh = engine.fresh(now, stale_after)
        waiting = (engine.waiting or 0) if fresh else 0
        slots_full = self.in_flight >= self.max_concurrency
        no_room = fresh and not self.has_engine_room(now, stale_after, kv_threshold)
        if not (waiting or queued or slots_full or no_room):
            return base
        running = max(1.0, float(self.in_flight), (engine.running or 0.0) if fresh else 0.0)
        return base + (waiting + queued + 1) * mean / running

    @property
    def load(self) -> float:
        return self.in_flight / self.max_concurrency

    @property
    def auth_headers(self) -> list[tuple[str, str]]:
        """The engine's own key, for the router's requests to it (models, metrics)."""
        return [("authorization", f"Bearer {self.api_key}")] if self.api_key else []

    def probed(self, ok: bool, now: float, config: HealthConfig, *, first: bool = False) -> None:
        """An active health check's result; `first` (at start-up) decides at once."""
        if now < self.ejected_until:
            return  # ejected backends sit out their time whatever the probes say
        if ok:
            self._probes_failed, self._probes_passed = 0, self._probes_passed + 1
            if not self.healthy and (first or self._probes_passed >= config.healthy_after):
                self.healthy = True
                state_log.info(
                    "backend %s (pool %s) healthy: %d health checks passed", *self._names, self._probes_passed
                )
        else:
            self._probes_failed, self._probes_passed = self._probes_failed + 1, 0
            if self.healthy and (first or self._probes_failed >= config.unhealthy_after):
                self.healthy = False
                state_log.warning(
                    "backend %s (pool %s) unhealthy: %d health checks failed", *self._names, self._probes_failed
                )

    def request_failed(self, now: float, config: HealthConfig) -> bool:
        """A request failed on this backend; returns True if that ejected it."""
        self._requests_failed += 1
        if self._requests_failed < config.eject_after or not self.healthy:
            return False
        self.ejections += 1
        self.ejected_for = min(config.max_ejection_seconds, config.ejection_seconds * 2 ** (self.ejections - 1))
        self.ejected_until = now + self.ejected_for
        self.healthy = False
        state_log.warning(
            "backend %s (pool %s) ejected for %g s: %d requests failed in a row",
            *self._names,
            self.ejected_for,
            self._requests_failed,
        )
        self._requests_failed = self._probes_passed = 0
        return True

    @property
    def _names(self) -> tuple[str, str]:
        return self.name, self.pool

    def request_succeeded(self) -> None:
        self._requests_failed = 0
        self.ejections = 0

    @property
    def has_room(self) -> bool:
        return self.accepting and self.in_flight < self.max_concurrency


class Pool:
    def __init__(
        self,
        name: str,
        *,
        speculative: bool,
        backends: list[Backend],
        queue_size: int,
        queue_timeout: float,
    ) -> None:
        self.name = name
        self.speculative = speculative
        self.backends = backends
        self.queue_size = queue_size
        self.queue_timeout = queue_timeout
        self._waiters: dict[JobClass, deque[asyncio.Future[Backend]]] = {
            "interactive": deque(),
            "batch": deque(),
        }
        self.mean_duration = 10.0  # seconds a request takes here, a running mean

    def queued(self, job: JobClass | None = None) -> int:
        if job is not None:
            return len(self._waiters[job])
        return sum(len(waiters) for waiters in self._waiters.values())

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
        return NoBackendAvailable(f"pool {self.name!r} {why}", retry_after=5, code="pool_unavailable")

    async def acquire(self, job: JobClass, *, exclude: frozenset[str] = frozenset()) -> Backend:
        if not self.accepting:
            raise self._unavailable()
        if not self.queued() or exclude:
            backend = self._take(exclude)
            if backend is not None:
                return backend
            if exclude:
                raise NoBackendAvailable(f"pool {self.name!r} has no other backend free", code="pool_unavailable")
        if self.queued() >= self.queue_size:
            raise NoBackendAvailable(
                f"pool {self.name!r} is full and its queue holds {self.queue_size} requests",
                retry_after=self._retry_after(),
                code="queue_full",
            )
        waiter: asyncio.Future[Backend] = asyncio.get_running_loop().create_future()
        self._waiters[job].append(waiter)
        try:
            async with asyncio.timeout(self.queue_timeout):
                return await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                # A slot was handed over just as we gave up: pass it on.
                self.release(waiter.result())
            else:
                waiter.cancel()
                with contextlib.suppress(ValueError):  # _wake may have dropped it already
                    self._waiters[job].remove(waiter)
            if isinstance(exc, TimeoutError):
                raise NoBackendAvailable(
                    f"pool {self.name!r} had no free backend within {self.queue_timeout:g} s",
                    retry_after=self._retry_after(),
                    code="queue_timeout",
                ) from exc
            raise

    def release(self, backend: Backend, *, duration: float | None = None) -> None:
        backend.in_flight -= 1
        if duration is not None:
            self.mean_duration += _EWMA * (duration - self.mean_duration)
        self.wake()

    def wake(self) -> None:
        """Hand free slots to queued requests (after a release, or a backend turning healthy or
        being drained or resumed); with no backend left to wait for, fail them at once."""
        while self.queued():
            queue = self._waiters["interactive"] or self._waiters["batch"]
            if queue[0].done():
                queue.popleft()  # cancelled while queued; its request has gone
                continue
            if not self.accepting:
                queue.popleft().set_exception(self._unavailable())
                continue
            backend = self._take()
            if backend is None:
                return
            queue.popleft().set_result(backend)

    def has_other(self, exclude: frozenset[str]) -> bool:
        """Whether a healthy backend not in `exclude` has room now (for a retry)."""
        return any(b.has_room and b.name not in exclude for b in self.backends)

    def _take(self, exclude: frozenset[str] = frozenset()) -> Backend | None:
        candidates = [b for b in self.backends if b.has_room and b.name not in exclude]
        if not candidates:
            return None
        backend = min(candidates, key=lambda b: b.load)
        backend.in_flight += 1
        return backend

    def _retry_after(self) -> int:
        capacity = sum(b.max_concurrency for b in self.backends if b.accepting) or 1
        wait = self.mean_duration * (self.queued() + 1) / capacity
        return max(1, min(60, math.ceil(wait)))


class Pools:
    """Every pool of the router, by name."""

    def __init__(self, settings: Settings) -> None:
        self._pools: dict[str, Pool] = {}
        self.reconcile(settings)

    def reconcile(self, settings: Settings) -> set[str]:
        """Take a (re)loaded configuration. A backend still configured in the same pool with the
        same URL is kept, with its requests in flight, health and readings; others are new.
        Requests running on a backend or pool that is gone finish there; its queue is failed.
        Returns the names of the backends that were not kept (new, gone, or at another URL).
        """
        before = {backend.name: backend for backend in self.backends()}
        pools: dict[str, Pool] = {}
        for name, config in settings.pools.items():
            old = self._pools.get(name)
            kept = {b.name: b for b in old.backends} if old is not None else {}
            backends = []
            for backend_name, backend_config in config.backends.items():
                backend = kept.get(backend_name)
                if backend is not None and backend.url == backend_config.url:
                    backend.configure(backend_config)
                else:
                    backend = Backend(backend_name, name, backend_config)
                backends.append(backend)
            if old is None:
                pools[name] = Pool(
                    name,
                    speculative=config.speculative,
                    backends=backends,
                    queue_size=config.queue_size,
                    queue_timeout=config.queue_timeout,
                )
            else:
                old.speculative, old.backends = config.speculative, backends
                old.queue_size, old.queue_timeout = config.queue_size, config.queue_timeout
                pools[name] = old
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

    def snapshot(self, speeds: SpeedModel, settings: Settings, *, now: float | None = None) -> dict[str, PoolState]:
        """The live state of every pool, as the policy sees it."""
        now = time.monotonic() if now is None else now
        stale_after = settings.scrape.stale_after
        kv_threshold = settings.routing.kv_threshold
        states = {}
        for pool in self:
            accepting = [b for b in pool.backends if b.accepting]
            if not accepting:
                draining = any(b.healthy and b.draining for b in pool.backends)
                states[pool.name] = PoolState(pool.speculative, healthy=False, draining=draining)
                continue
            projected = [kv for b in accepting if (kv := b.kv_projected(now, stale_after)) is not None]
            # Requests waiting inside an engine count as a queue only on two scrapes running and
            # while the engine shows no room of its own: one noisy reading moves nobody.
            queued = sum(
                b.engine.queued or 0
                for b in accepting
                if b.engine.fresh(now, stale_after) and not b.has_engine_room(now, stale_after, kv_threshold)
            )
            load = {b.name: b.concurrency(now, stale_after) for b in accepting}
            best = min(accepting, key=lambda b: (load[b.name] / b.max_concurrency, b.name))
            concurrency = load[best.name]
            gain = best.accept_length(now, settings.scrape.acceptance_max_age)
            ttft = min(
                b.predicted_ttft(
                    now,
                    queued=pool.queued(),
                    kv_threshold=kv_threshold,
                    stale_after=stale_after,
                    mean=pool.mean_duration,
                )
                for b in accepting
            )
            states[pool.name] = PoolState(
                speculative=pool.speculative,
                concurrency=concurrency,
                has_room=not pool.queued() and any(b.has_room for b in accepting),
                engine_queued=queued,
                kv_usage=min(projected, default=None),  # the emptiest backend is where it would go
                ttft=ttft,
                speed={
                    kind: speeds.predict(best.name, kind, concurrency + 1, gain=gain, fallback=not pool.speculative)
                    for kind in CONTENT_KINDS
                },
            )
        return states


class Clients:
    """Requests in flight per client, and a fading memory of each client's recent peak.

    A batch job that was running a hundred requests a moment ago is still a batch job when its
    next burst begins: `load()` is the larger of what the client has in flight now and its past
    peak, halved every `memory` seconds.
    """

    _PURGE_AT = 10_000  # forget faded clients once this many are remembered

    def __init__(self, *, memory: float = 0.0, burst_hold: float = 0.0, threshold: int = 4) -> None:
        self.configure(memory=memory, burst_hold=burst_hold, threshold=threshold)
        self._in_flight: dict[str, int] = {}
        self._peaks: dict[str, tuple[float, float]] = {}  # client -> (peak, when)
        self._holds: dict[str, asyncio.Event] = {}  # clients whose first requests are held

    def configure(self, *, memory: float, burst_hold: float, threshold: int) -> None:
        self._memory = memory
        self._burst_hold = burst_hold
        self._threshold = threshold

    async def settle(self, client: str) -> None:
        """Hold the first requests of a client not seen lately, for at most `burst_hold` seconds or
        until more than `threshold` of them are here: a batch job's first burst then shows itself
        before any of it is classified, and an interactive user's first request waits that long."""
        hold = self._holds.get(client)
        if hold is None:
            if not self._burst_hold or self[client] > 1 or self._remembered(client, time.monotonic()) >= 1:
                return
            hold = self._holds[client] = asyncio.Event()
        try:
            async with asyncio.timeout(self._burst_hold):
                await hold.wait()
        except TimeoutError:
            pass
        finally:
            if self._holds.get(client) is hold:
                del self._holds[client]  # the hold ends for everyone waiting on it

    def __getitem__(self, client: str) -> int:
        return self._in_flight.get(client, 0)

    def load(self, client: str, now: float | None = None) -> float:
        return max(self[client], self._remembered(client, time.monotonic() if now is None else now))

    def start(self, client: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        count = self._in_flight.get(client, 0) + 1
        self._in_flight[client] = count
        if count > self._threshold and client in self._holds:
            self._holds[client].set()  # enough of a burst: classify them all now
        if self._memory and count >= self._remembered(client, now):
            if len(self._peaks) >= self._PURGE_AT:
                self._purge(now)
            self._peaks[client] = (count, now)

    def finish(self, client: str) -> None:
        left = self._in_flight[client] - 1
        if left:
            self._in_flight[client] = left
        else:
            del self._in_flight[client]

    def _remembered(self, client: str, now: float) -> float:
        if not self._memory or client not in self._peaks:
            return 0.0
        peak, when = self._peaks[client]
        return float(peak * 0.5 ** ((now - when) / self._memory))

    def _purge(self, now: float) -> None:
        for client in [c for c in self._peaks if self._remembered(c, now) < 1 and c not in self._in_flight]:
            del self._peaks[client]
