"""Live pool state: backends with their requests in flight, and each pool's bounded queue.

A request takes a slot with `await pool.acquire(job)` and gives it back with `pool.release()`.
When every healthy backend is at `max_concurrency`, it waits in the pool's queue, interactive
requests ahead of batch ones, until a slot frees, the queue wait runs out, or it is cancelled.
A queued request is not yet bound to a backend, so the queue belongs to the pool.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Iterator

from router.config import Backend as BackendConfig
from router.config import JobClass, Settings
from router.errors import NoBackendAvailable

_EWMA = 0.2  # weight of the newest request duration in the pool's running mean


class Backend:
    def __init__(self, name: str, pool: str, config: BackendConfig) -> None:
        self.name = name
        self.pool = pool
        self.url = config.url
        self.api_key = config.api_key()
        self.max_concurrency = config.max_concurrency
        self.in_flight = 0
        self.healthy = True
        self.recent_ttft: deque[float] = deque(maxlen=256)

    @property
    def load(self) -> float:
        return self.in_flight / self.max_concurrency

    @property
    def has_room(self) -> bool:
        return self.healthy and self.in_flight < self.max_concurrency


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
        self._mean_duration = 10.0

    def queued(self, job: JobClass | None = None) -> int:
        if job is not None:
            return len(self._waiters[job])
        return sum(len(waiters) for waiters in self._waiters.values())

    @property
    def in_flight(self) -> int:
        return sum(backend.in_flight for backend in self.backends)

    @property
    def healthy(self) -> bool:
        return any(backend.healthy for backend in self.backends)

    async def acquire(self, job: JobClass) -> Backend:
        if not self.healthy:
            raise NoBackendAvailable(
                f"pool {self.name!r} has no healthy backend", retry_after=5, code="pool_unavailable"
            )
        if not self.queued():
            backend = self._take()
            if backend is not None:
                return backend
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
            if waiter.done() and not waiter.cancelled():
                # A slot was handed over just as we gave up: pass it on.
                self.release(waiter.result())
            else:
                waiter.cancel()
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
            self._mean_duration += _EWMA * (duration - self._mean_duration)
        self._wake()

    def wake(self) -> None:
        """Hand free slots to queued requests (after a backend turns healthy, say)."""
        self._wake()

    def _wake(self) -> None:
        while self.queued():
            backend = self._take()
            if backend is None:
                return
            queue = self._waiters["interactive"] or self._waiters["batch"]
            queue.popleft().set_result(backend)

    def _take(self) -> Backend | None:
        candidates = [b for b in self.backends if b.has_room]
        if not candidates:
            return None
        backend = min(candidates, key=lambda b: b.load)
        backend.in_flight += 1
        return backend

    def _retry_after(self) -> int:
        capacity = sum(b.max_concurrency for b in self.backends if b.healthy) or 1
        wait = self._mean_duration * (self.queued() + 1) / capacity
        return max(1, min(60, math.ceil(wait)))


class Pools:
    """Every pool of the router, by name."""

    def __init__(self, settings: Settings) -> None:
        self._pools = {
            name: Pool(
                name,
                speculative=config.speculative,
                backends=[Backend(b, name, bc) for b, bc in config.backends.items()],
                queue_size=config.queue_size,
                queue_timeout=config.queue_timeout,
            )
            for name, config in settings.pools.items()
        }

    def __getitem__(self, name: str) -> Pool:
        return self._pools[name]

    def __iter__(self) -> Iterator[Pool]:
        return iter(self._pools.values())

    def backends(self) -> Iterator[Backend]:
        for pool in self:
            yield from pool.backends


class Clients:
    """Requests in flight per client, for the classifier's batch heuristic."""

    def __init__(self) -> None:
        self._in_flight: dict[str, int] = {}

    def __getitem__(self, client: str) -> int:
        return self._in_flight.get(client, 0)

    def start(self, client: str) -> None:
        self._in_flight[client] = self._in_flight.get(client, 0) + 1

    def finish(self, client: str) -> None:
        left = self._in_flight[client] - 1
        if left:
            self._in_flight[client] = left
        else:
            del self._in_flight[client]
