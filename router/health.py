"""Active health checks: each backend's `/health`, probed on an interval.

A backend leaves after `unhealthy_after` failed probes in a row and comes back after
`healthy_after` good ones; one ejected for failing requests (see `Backend.request_failed`) sits
out its ejection time first.
"""

from __future__ import annotations

import asyncio
import time

from router.config import Health
from router.pools import Backend, Pools
from router.upstream import TransportError, UpstreamPool


class HealthChecker:
    def __init__(self, pools: Pools, upstream: UpstreamPool, config: Health) -> None:
        self._pools = pools
        self._upstream = upstream
        self.config = config  # replaced on a reload

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval)
            await self.check_all()

    async def check_all(self, *, first: bool = False) -> None:
        """Probe every backend; `first` (at start-up) takes each result at once."""
        await asyncio.gather(*(self._check(backend, first) for backend in self._pools.backends()))
        for pool in self._pools:
            pool.wake()

    async def _check(self, backend: Backend, first: bool) -> None:
        # Probes go straight to the engine: they are not requests, and count in no metric.
        try:
            async with asyncio.timeout(self.config.timeout):
                status, _ = await self._upstream.get(backend.url + "/health")
            ok = status == 200
        except (TransportError, TimeoutError):
            ok = False
        backend.probed(ok, time.monotonic(), self.config, first=first)
