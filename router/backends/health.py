"""Active health checks: each backend's `/health`, probed on an interval.

A backend leaves after `unhealthy_after` failed probes in a row and comes back after
`healthy_after` good ones; one ejected for failing requests (see `Backend.request_failed`) sits
out its ejection time first (router.outlier keeps that state; this module only probes).
"""

from __future__ import annotations

import asyncio
import logging

from router.backends.backend import Backend
from router.backends.pools import Pools
from router.clock import Clock
from router.config import Health
from router.logs import Unforeseen
from router.transport import TlsError, Transport, TransportError

logger = logging.getLogger("specroute")


class HealthChecker:
    def __init__(self, pools: Pools, transport: Transport, *, clock: Clock, via: str) -> None:
        """`via`: this router's `Via` entry, sent with each probe; the router's own `/health`
        answers 508 to a probe carrying it (router.app), so it never becomes its own backend."""
        self._pools = pools
        self._via = [("via", via)]
        self._transport = transport
        self._clock = clock
        self._config = Health()
        self._tls_failing: set[str] = set()  # backends whose TLS failure is logged already
        self._looping: set[str] = set()  # backends found to be this router, logged already
        self._unforeseen = Unforeseen(logger)

    def configure(self, config: Health) -> None:
        self._config = config

    def forget(self, backend: str) -> None:
        """A backend gone: what was logged of it once is said again if it comes back."""
        self._tls_failing.discard(backend)
        self._looping.discard(backend)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._config.interval)
            try:
                await self.check_all()
            except Exception as exc:  # a bug of ours: never the end of every backend's checks
                self._unforeseen.log(exc, "health checks failed")

    async def check_all(self, *, first: bool = False) -> None:
        """Probe every backend; `first` (at start-up) takes each result at once."""
        await self.probe(list(self._pools.backends()), first=first)

    async def probe(self, backends: list[Backend], *, first: bool = False) -> None:
        """Probe these backends (a backend just found, router.backends.discovery: `first`)."""
        await asyncio.gather(*(self._check(backend, first) for backend in backends))
        for pool in self._pools:
            pool.wake()

    async def _check(self, backend: Backend, first: bool) -> None:
        # Probes go straight to the engine: they are not requests, and count in no metric.
        try:
            async with asyncio.timeout(self._config.timeout):
                status, _ = await self._transport.get(backend.url + "/health", headers=self._via)
            ok = status == 200
            if status == 508 and backend.name not in self._looping:  # once, not every interval
                self._looping.add(backend.name)
                logger.warning(
                    "backend %s (pool %s) is this router itself: it takes no work", backend.name, backend.pool
                )
        except TlsError as exc:
            ok = False
            if backend.name not in self._tls_failing:  # once, not every interval
                self._tls_failing.add(backend.name)
                logger.warning("backend %r fails its health check: %s", backend.name, exc)
        except (TransportError, TimeoutError):
            ok = False
        except Exception as exc:  # a library's or ours, an answer no check foresaw: a failed probe
            ok = False
            self._unforeseen.log(exc, "backend %s (pool %s): a health check failed", backend.name, backend.pool)
        else:
            self._tls_failing.discard(backend.name)
            if ok:
                self._looping.discard(backend.name)
        backend.outlier.probed(self._clock.now(), ok, first=first)
