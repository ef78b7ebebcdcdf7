"""`BatchService`: the Batch API's parts for one router, started and stopped with it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio

from router.batch.api import batch_routes
from router.batch.metrics import BatchMetrics
from router.batch.runner import Runner
from router.batch.store import SqliteStore, Store
from router.config import Batch as BatchConfig

if TYPE_CHECKING:
    from starlette.routing import BaseRoute

    from router.runtime import Router


class BatchService:
    def __init__(self, router: Router, *, clock: Callable[[], float]) -> None:
        self.router = router
        self._clock = clock
        self.metrics = BatchMetrics(router.metrics.registry)
        self._store: Store | None = None
        self._runner: Runner | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def config(self) -> BatchConfig:
        return self.router.settings.batch

    @property
    def store(self) -> Store:
        assert self._store is not None, "the batch store opens with the app's lifespan"
        return self._store

    @property
    def runner(self) -> Runner:
        assert self._runner is not None, "the batch runner starts with the app's lifespan"
        return self._runner

    def now(self) -> int:
        return int(self._clock())

    def routes(self) -> list[BaseRoute]:
        return batch_routes(self)

    async def start(self) -> None:
        """Open the store and run every batch left unfinished, by this router or a previous one."""
        directory = self.config.store_dir  # read once: a reload cannot move the store
        self._store = await anyio.to_thread.run_sync(SqliteStore, directory)
        self._runner = runner = Runner(self.router, self._store, self.metrics, clock=self._clock)
        self.metrics.in_flight = lambda: runner.in_flight
        self._task = asyncio.create_task(runner.run())

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
            "store": str(getattr(self._store, "path", None)),
            "by_status": self.metrics.by_status,
            "concurrency_limit": runner.limit if runner else 0,
            "in_flight": runner.in_flight if runner else 0,
            "active": [
                {
                    "id": batch.id,
                    "status": batch.status,
                    "total": batch.total,
                    "completed": batch.completed,
                    "failed": batch.failed,
                    "expires_at": batch.expires_at,
                }
                for batch in (runner.active if runner else [])
            ],
        }
