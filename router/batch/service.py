"""`BatchService`: the Batch API's parts for one router, started and stopped with it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio

from router.batch.copies import Copies
from router.batch.metrics import BatchMetrics
from router.batch.runner import Runner
from router.batch.sqlite import SqliteStore
from router.batch.store import Store
from router.config import Batch as BatchConfig
from router.errors import NoBackendAvailable

if TYPE_CHECKING:
    from router.runtime import Router


logger = logging.getLogger("specroute.batch")

# How often a store that could not be opened is tried again: also the Retry-After its 503 gives,
# so a client retrying as told finds the store open as soon as it can be.
REOPEN_SECONDS = 5


class BatchService:
    def __init__(self, router: Router, *, clock: Callable[[], float]) -> None:
        self.router = router
        self._clock = clock
        self.metrics = BatchMetrics(router.metrics.registry)
        self.copies = Copies()  # of files being downloaded or read into a batch
        self._store: Store | None = None
        self._runner: Runner | None = None
        self._task: asyncio.Task[None] | None = None
        self.config = BatchConfig()  # until `configure`, which the router's `apply` calls as it starts
        self._enabled = False
        self._started_with: BatchConfig | None = None  # the store's settings, as the router started
        self._unavailable: str | None = None  # why the store could not be opened

    def configure(self, config: BatchConfig) -> None:
        """The Batch API's section, from `Router.apply` at start and on every reload (the one path
        of the settings). Whether the API is on and where its store is are taken the first time
        only: they need a restart (runtime.NEEDS_RESTART)."""
        if self._started_with is None:
            self._started_with = config
            self._enabled = config.enabled
        self.config = config
        if self._runner is not None:
            self._runner.configure(config)

    @property
    def store(self) -> Store:
        if self._store is None:
            raise NoBackendAvailable(
                f"the batch store is not available: {self._unavailable or 'not open yet'}",
                retry_after=REOPEN_SECONDS,
                code="batch_store_unavailable",
            )
        return self._store

    @property
    def runner(self) -> Runner:
        assert self._runner is not None, "the batch runner starts with the app's lifespan"
        return self._runner

    def now(self) -> int:
        return int(self._clock())

    @property
    def enabled(self) -> bool:
        """Whether the Files and Batches endpoints are served (router.batch.api mounts them)."""
        return self._enabled

    async def start(self) -> None:
        """Open the store and run every batch left unfinished, by this router or a previous one.
        While the store cannot be opened (a database not up yet), the router serves live traffic,
        the Batch API answers 503 `batch_store_unavailable`, and the store is tried again every
        `REOPEN_SECONDS`."""
        if not self._enabled:
            return
        opened = await self._open()
        self._task = asyncio.create_task(self._run(opened))

    async def _open(self) -> bool:
        try:
            self._store = await anyio.to_thread.run_sync(self._connect)
        except (OSError, sqlite3.Error, RuntimeError, NoBackendAvailable) as exc:
            self._unavailable = f"{self._where()}: {exc}"
            logger.error("batch store not opened, the Batch API answers 503: %s", self._unavailable)
            return False
        self._unavailable = None
        self._runner = runner = Runner(self.router, self._store, self.metrics, clock=self._clock)
        runner.configure(self.config)
        self.metrics.in_flight = lambda: runner.in_flight
        self.metrics.per_second = runner.rate.per_second
        return True

    async def _run(self, opened: bool) -> None:
        while not opened:
            await anyio.sleep(REOPEN_SECONDS)
            opened = await self._open()
        await self.runner.run()

    def _connect(self) -> Store:
        config = self._started_with  # as the router started: a reload cannot move the store
        assert config is not None, "Router.apply configures the service as the router starts"
        if config.store == "sqlite":
            return SqliteStore(config.store_dir, clock=self._clock)
        dsn = config.postgres_dsn()
        if not dsn:
            raise RuntimeError(f"${config.postgres_dsn_env} (batch.postgres_dsn_env) is not set")
        try:
            # The driver is an extra, loaded only when this store is configured.
            from router.batch.postgres import PostgresStore
        except ImportError as exc:
            raise RuntimeError(f"{exc}: install the driver with pip install 'specroute[postgres]'") from exc
        return PostgresStore(dsn, spool_dir=config.store_dir, clock=self._clock)

    def _where(self) -> str:
        """The store, named for the status page and the log: never the DSN (it may hold a password)."""
        config = self._started_with
        assert config is not None, "Router.apply configures the service as the router starts"
        if config.store == "sqlite":
            return str(SqliteStore.file(config.store_dir))
        return f"postgres (DSN in ${config.postgres_dsn_env})"

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._store is not None:
            await anyio.to_thread.run_sync(self._store.close)

    def status(self) -> dict[str, Any]:
        """For /router/status: the batches under way and how hard they are pushed."""
        runner = self._runner
        return {
            "enabled": self._enabled,
            "store": self._where() if self._store is not None else None,
            "store_error": self._unavailable,
            "by_status": self.metrics.by_status,
            "concurrency_limit": runner.limit if runner else 0,
            "in_flight": runner.in_flight if runner else 0,
            # Lines recorded by this router since it started, and per second over the last
            # RATE_WINDOW seconds (of the clock batches are timed by).
            "lines": dict(runner.lines) if runner else {"completed": 0, "failed": 0},
            "lines_per_second": round(runner.rate.per_second(), 3) if runner else 0.0,
            "copies_bytes": self.copies.held,  # temporary copies of files open now (copies.py)
            # No ids: /router/status needs no key, and a batch is its owner's to name.
            "active": [
                {
                    "status": batch.status,
                    "total": batch.total,
                    "completed": batch.completed,
                    "failed": batch.failed,
                    "expires_at": batch.expires_at,
                }
                for batch in (runner.active if runner else [])
            ],
        }
