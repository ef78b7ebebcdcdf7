"""Runs the batches' lines in the throughput that live traffic leaves free.

Each line is sent through the router's own request path by an in-process client (client.py),
as the router's own request declared `batch`, so it is classified, admitted, queued, retried,
measured and logged like any other request. The runner only decides how many lines run at once, and which:

- A line starts only while the batch pool has more than `reserve_slots` free slots and nothing
  waiting in its queue, so a live request never waits behind one; the speculative pool's idle
  room is used only with `routing.batch_may_use_speculative`, when the batch pool has none.
- On top of that, a limit adapts (AIMD): it doubles while nothing pushes back, then grows by one
  a tick; it halves when the batch pool queues, its engines report waiting requests at two ticks running, or its
  recent first-token p50 rises past `ttft_rise` times the lowest seen.
- Batches take turns line by line (round robin), so a big batch does not hold back a small one.

A line is recorded only once its result is committed (see store.py). A line in flight when the
router dies is run again after the restart: at least once for that line, exactly once recorded.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
import uuid
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio
from anyio.abc import TaskGroup

from router.backends.pools import Pool
from router.batch.client import InProcessClient
from router.batch.metrics import BatchMetrics
from router.batch.store import BatchRecord, BatchStatus, Line, Store
from router.config import Batch as BatchConfig

if TYPE_CHECKING:
    from router.runtime import Router

logger = logging.getLogger("specroute.batch")

# Router answers that mean "not now": the line is tried again later rather than failed (as is a
# line with no answer at all: an empty body, or the router's own fault).
_TRANSIENT = frozenset({429, 502, 503, 504})
_CLAIM = 8  # lines taken from the store at once per batch
_TTFT_SAMPLES = 32
_TTFT_MIN_SAMPLES = 8
RATE_WINDOW = 60  # seconds of the runner's clock that lines per second is measured over


class Runner:
    def __init__(self, router: Router, store: Store, metrics: BatchMetrics, *, clock: Callable[[], float]) -> None:
        self._router = router
        self._client = InProcessClient(router.pipeline)
        self._store = store
        self._metrics = metrics
        self._clock = clock
        self.owner = uuid.uuid4().hex  # this router's name on the leases it takes
        self.limit = 1  # lines allowed in flight, adapted each tick
        self._slow_start = True
        self.in_flight = 0
        self._starting = 0  # lines started that have not reached a pool yet
        self._by_batch: dict[str, int] = {}  # lines in flight per batch
        self._turns: deque[str] = deque()  # batches taking lines, in turn
        self._waiting: dict[str, deque[Line]] = {}  # lines taken from the store, not yet started
        # Leases this router keeps renewing: taken lines, until answered or given up.
        self._held: set[tuple[str, int]] = set()
        self._dry: set[str] = set()  # batches with nothing to take until the next tick
        self._ttft_floor: float | None = None
        self._engine_waited = False  # the batch pool's engines reported waiting requests at the last tick
        self._ttft_seen: tuple[float, ...] = ()
        self._wake = anyio.Event()
        self._news = False  # woken since the last full look at the store
        self.active: list[BatchRecord] = []  # as of the last tick, for the status page
        self.configure(BatchConfig())
        self.lines = {"completed": 0, "failed": 0}  # recorded by this router since it started
        self.rate = Rate(clock)

    def configure(self, config: BatchConfig) -> None:
        """The Batch API's section, handed on by the service from `Router.apply`; read where used."""
        self.config = config

    def wake(self) -> None:
        """Look for work now (a batch was created or cancelled, a line finished)."""
        self._news = True
        self._wake.set()

    async def run(self) -> None:
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(self._renew_leases)
                next_tick = 0.0
                while True:
                    try:
                        if time.monotonic() >= next_tick:
                            next_tick = time.monotonic() + self.config.poll_interval
                            await self._tick()
                        await self._dispatch(group)
                    except Exception:  # the store failed (disk full, locked too long): try again next tick
                        logger.exception("batch runner: the store failed; trying again")
                    with anyio.move_on_after(max(0.0, next_tick - time.monotonic())):
                        await self._wake.wait()
                    self._wake = anyio.Event()
        finally:
            # Stopped (shutdown): lines taken and not answered go back at once, not after their lease.
            with anyio.CancelScope(shield=True):
                try:
                    await anyio.to_thread.run_sync(self._store.release, self.owner)
                except Exception:  # the store failed: the leases lapse instead
                    logger.exception("batch runner: leases not given back")

    async def _renew_leases(self) -> None:
        while True:
            await anyio.sleep(self.config.lease_seconds / 3)
            renew = partial(
                self._store.renew, self.owner, sorted(self._held), self._clock() + self.config.lease_seconds
            )
            try:
                await anyio.to_thread.run_sync(renew)
            except Exception:  # the store failed: the leases may lapse, and the lines run again
                logger.exception("batch runner: leases not renewed")

    # Each tick: batch states, expiry, and the concurrency limit.

    async def _tick(self) -> None:
        now = self._clock()
        self._dry.clear()
        active = await anyio.to_thread.run_sync(self._store.active)
        if not active and not self.active and not self._news:
            # No batch in the store, now or at the last look, and none created here since: nothing
            # to start or finish, and the counts by status are as they were (one query a tick in a
            # thread, not three). Only a batch created and ended by another router sharing the
            # store between two looks goes uncounted until the next one is active.
            self._adapt()
            return
        self._news = False
        running: list[str] = []
        for batch in active:
            if batch.status == "validating":
                start = partial(self._store.set_status, batch.id, "in_progress", int(now), before=("validating",))
                await anyio.to_thread.run_sync(start)
                running.append(batch.id)
            elif batch.status == "in_progress" and now < batch.expires_at:
                if await anyio.to_thread.run_sync(self._store.pending, batch.id):
                    running.append(batch.id)
                else:
                    done = partial(self._store.set_status, batch.id, "finalizing", int(now), before=("in_progress",))
                    await anyio.to_thread.run_sync(done)
                    await self._finish(batch, "completed", now)
            elif batch.status == "finalizing":
                await self._finish(batch, "completed", now)  # a router stopped while finalizing it
            elif not self._by_batch.get(batch.id):  # expired or cancelling, and nothing left running here
                await self._finish(batch, "expired" if batch.status == "in_progress" else "cancelled", now)
        # Batches leave the turns when they end; new ones join at the back.
        self._turns = deque([b for b in self._turns if b in running] + [b for b in running if b not in self._turns])
        for gone in set(self._waiting) - set(running):
            self._held -= {(line.batch_id, line.idx) for line in self._waiting.pop(gone)}
        self.active = await anyio.to_thread.run_sync(self._store.active)
        self._metrics.by_status = await anyio.to_thread.run_sync(self._store.count_by_status)
        self._adapt()

    async def _finish(self, batch: BatchRecord, status: BatchStatus, now: float) -> None:
        output, error = f"file-{uuid.uuid4().hex[:24]}", f"file-{uuid.uuid4().hex[:24]}"
        await anyio.to_thread.run_sync(
            lambda: self._store.finish(batch.id, status, int(now), output_id=output, error_id=error)
        )
        logger.info("batch %s %s", batch.id, status)

    def _adapt(self) -> None:
        """Additive increase, multiplicative decrease of the lines allowed in flight."""
        pool = self._pool()
        if pool is not None and self._pushed_back(pool):
            self.limit = max(1, self.limit // 2)
            self._slow_start = False
        elif self.in_flight >= self.limit:  # the limit, not the pools, held the batches back
            grown = self.limit * 2 if self._slow_start else self.limit + 1
            self.limit = min(self.config.max_concurrency, grown)
        self._metrics.limit = self.limit

    def _pushed_back(self, pool: Pool) -> bool:
        """Whether live traffic on the batch pool shows strain: queueing, or first tokens slowing."""
        now = self._router.clock.now()
        stale_after = self._router.plan.stale_after
        if pool.queued():
            return True
        # A request just sent waits inside the engine until its next step: only requests waiting
        # at two looks running mean the engine is full (as the routing policy reads it).
        waiting = any(
            b.engine.reading.fresh(now, stale_after) and (b.engine.reading.waiting or 0) > 0 for b in pool.backends
        )
        waited_before, self._engine_waited = self._engine_waited, waiting
        if waiting and waited_before:
            return True
        recent = tuple(t for b in pool.backends for t in list(b.first_tokens.recent)[-_TTFT_SAMPLES:])
        if len(recent) < _TTFT_MIN_SAMPLES or recent == self._ttft_seen:
            return False  # too few live first tokens to judge, or none new since the last tick
        self._ttft_seen = recent
        p50 = statistics.median(recent)
        if self._ttft_floor is None or p50 < self._ttft_floor:
            self._ttft_floor = p50
        return p50 > self.config.ttft_rise * self._ttft_floor

    # Starting lines.

    def _pool(self) -> Pool | None:
        return self._router.pools.get(self._router.plan.batch_pool)

    def _room(self) -> int:
        """How many more lines may start now."""
        if self._router.shutting_down:
            return 0
        reserve = self.config.reserve_slots
        pool = self._pool()
        free = 0
        if pool is not None and pool.accepting and not pool.queued():
            free = max(0, _free_slots(pool) - reserve)
        plan = self._router.plan
        spec = self._router.pools.get(plan.interactive_pool)
        if (
            plan.routing.batch_may_use_speculative
            and spec is not None
            and spec is not pool
            and (pool is None or not pool.accepting or _free_slots(pool) == 0)
            and not spec.queued()
        ):
            # Idle room only: below the concurrency at which interactive users would feel it.
            idle = min(plan.routing.crossover.values()) - spec.in_flight
            free += max(0, min(idle, _free_slots(spec) - reserve))
        # Lines started and not yet admitted do not show in the pools' counts yet.
        return min(free - self._starting, self.limit - self.in_flight)

    async def _dispatch(self, group: TaskGroup) -> None:
        """Start lines while there is room, one batch after another."""
        while self._room() > 0:
            line = await self._next_line()
            if line is None:
                return
            self.in_flight += 1
            self._starting += 1
            self._by_batch[line.batch_id] = self._by_batch.get(line.batch_id, 0) + 1
            group.start_soon(self._execute, line)

    async def _next_line(self) -> Line | None:
        for _ in range(len(self._turns)):
            batch_id = self._turns[0]
            self._turns.rotate(-1)
            if batch_id in self._dry:
                continue
            waiting = self._waiting.setdefault(batch_id, deque())
            if not waiting:
                now = self._clock()
                n = min(_CLAIM, max(1, self._room()))
                until = now + self.config.lease_seconds
                claim = partial(self._store.claim, batch_id, self.owner, n, now=now, until=until)
                claimed = await anyio.to_thread.run_sync(claim)
                if not claimed:
                    self._dry.add(batch_id)
                    continue
                waiting.extend(claimed)
                self._held |= {(line.batch_id, line.idx) for line in claimed}
            return waiting.popleft()
        return None

    # Running one line.

    async def _execute(self, line: Line) -> None:
        try:
            request_id = f"batch_req_{uuid.uuid4().hex}"
            try:
                status, body = await self._call(line, request_id)
            except Exception:  # a bug on the request path must not end the runner; the line waits
                logger.exception("batch line %s of %s failed in the router", line.custom_id, line.batch_id)
                status, body = 500, None
            await self._save(line, request_id, status, body)
        except Exception:  # not recorded: the line stays leased, and is run again once its lease runs out
            logger.exception("batch line %s of %s: its result could not be stored", line.custom_id, line.batch_id)
        finally:
            # Answered, put back, or (the store failing) left to expire and be taken again.
            self._held.discard((line.batch_id, line.idx))
            self.in_flight -= 1
            left = self._by_batch[line.batch_id] - 1
            if left:
                self._by_batch[line.batch_id] = left
            else:
                del self._by_batch[line.batch_id]
            self.wake()

    async def _save(self, line: Line, request_id: str, status: int, body: Any) -> None:
        """Record the line's answer, or put it back for later if the router had no room for it."""
        if (status in _TRANSIENT or body is None) and line.attempts + 1 < self.config.max_attempts:
            backoff = self.config.retry_backoff * 2**line.attempts
            await anyio.to_thread.run_sync(self._store.retry_later, line, self._clock() + backoff)
            self._metrics.retries.inc()
            return
        failed = not 200 <= status < 300  # OpenAI's output file holds successes only: a 3xx is not one
        result = {
            "id": request_id,
            "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body},
            "error": None,
        }
        if await anyio.to_thread.run_sync(lambda: self._store.record(line, result, failed=failed)):
            kind = "failed" if failed else "completed"
            self._metrics.lines.labels(kind).inc()
            self.lines[kind] += 1
            self.rate.add()

    async def _call(self, line: Line, request_id: str) -> tuple[int, Any]:
        """The line through the router's own request path; its status and JSON body."""
        admitted = False

        def entered_a_pool() -> None:
            nonlocal admitted
            admitted = True
            self._starting -= 1

        headers = [
            (b"content-type", b"application/json"),
            (b"x-request-id", request_id.encode()),
            (self._router.plan.job_header.encode(), b"batch"),
        ]
        try:
            reply = await self._client.post(line.url, line.body.encode(), headers=headers, admitted=entered_a_pool)
        finally:
            if not admitted:  # answered before it reached a pool (an error of its own)
                self._starting -= 1
        status = reply.status or 500  # the path ended without answering: a fault of the router's own
        try:
            return status, json.loads(reply.body)
        except ValueError:
            return status, reply.body.decode("utf-8", "replace") if reply.body else None


class Rate:
    """Lines recorded per second over the last `window` seconds of `clock` (the runner's: a test
    moves it), counted per whole second: at most `window` counts kept, whatever the rate."""

    def __init__(self, clock: Callable[[], float], window: int = RATE_WINDOW) -> None:
        self._clock = clock
        self._window = window
        self._seconds: deque[list[int]] = deque()  # [second, lines recorded in it], oldest first

    def add(self) -> None:
        second = int(self._clock())
        if self._seconds and self._seconds[-1][0] == second:
            self._seconds[-1][1] += 1
        else:
            self._seconds.append([second, 1])
        self._trim(second)

    def per_second(self) -> float:
        """Read from any thread (a scrape): a copy is read, only `add` trims."""
        since = int(self._clock()) - self._window
        return sum(count for second, count in list(self._seconds) if second > since) / self._window

    def _trim(self, now: int) -> None:
        while self._seconds and self._seconds[0][0] <= now - self._window:
            self._seconds.popleft()


def _free_slots(pool: Pool) -> int:
    return sum(max(0, b.max_concurrency - b.in_flight) for b in pool.backends if b.accepting)
