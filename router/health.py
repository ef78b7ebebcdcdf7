"""Active health checks: each backend's `/health`, probed on an interval."""

from __future__ import annotations

import asyncio

from router.config import Health
from router.pools import Backend, Pools
from router.upstream import TransportError, UpstreamPool


class HealthChecker:
    def __init__(self, pools: Pools, upstream: UpstreamPool, config: Health) -> None:
        self._pools = pools
        self._upstream = upstream
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
            async with asyncio.timeout(self._config.timeout):
                status, _ = await self._upstream.get(backend.url + "/health")
            backend.healthy = status == 200
        except (TransportError, TimeoutError):
            backend.healthy = False
