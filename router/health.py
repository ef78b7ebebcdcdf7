"""Active health checks: each backend's `/health`, probed on an interval."""

from __future__ import annotations

import asyncio

import httpx

from router.config import Health
from router.pools import Backend, Pools


class HealthChecker:
    def __init__(self, pools: Pools, http: httpx.AsyncClient, config: Health) -> None:
        self._pools = pools
        self._http = http
        self._config = config

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._config.interval)
            await self.check_all()

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(backend) for backend in self._pools.backends()))
        for pool in self._pools:
            pool.wake()

    async def _check(self, backend: Backend) -> None:
        try:
            response = await self._http.get(backend.url + "/health", timeout=self._config.timeout)
            backend.healthy = response.status_code == 200
        except httpx.HTTPError:
            backend.healthy = False
