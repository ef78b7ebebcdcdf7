"""`GET /v1/models`: the union of every backend's models, cached briefly; `GET /v1/models/{id}`:
one of them (vLLM serves no such route, so the router answers it from the same list).

The names it last saw are also the values the metrics' `model` label may take, so it refreshes
itself in the background (`run`) even when no client asks for the list.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from router.backends.backend import Backend
from router.backends.pools import Pools
from router.clock import Clock
from router.logs import Unforeseen
from router.transport import Transport, TransportError

# How often the background refresh asks the backends; a model added to an engine is counted
# under its own name from then on (before that, as `other`).
REFRESH_SECONDS = 30.0

logger = logging.getLogger("specroute")


class ModelCatalog:
    MAX_KNOWN = 1_000  # model names remembered; past them a new name's label is "other"

    def __init__(self, pools: Pools, transport: Transport, *, clock: Clock) -> None:
        self._pools = pools
        self._transport = transport
        self._clock = clock
        self._lock = asyncio.Lock()
        self.known: frozenset[str] = frozenset()  # model ids seen since start (never shrinks; capped)
        self._unforeseen = Unforeseen(logger)
        self.configure(ttl=0.0, timeout=1.0)

    def configure(self, *, ttl: float, timeout: float) -> None:
        """(Re)loaded settings; the backends may have changed, so the cached list goes."""
        self._ttl = ttl
        self._timeout = timeout
        self._cached: list[dict[str, Any]] | None = None
        self._fetched_at = 0.0

    async def models(self) -> list[dict[str, Any]]:
        async with self._lock:  # one refresh at a time; the others take its result
            if self._cached is None or self._clock.now() - self._fetched_at > self._ttl:
                self._cached = await self._fetch()
                self._fetched_at = self._clock.now()
            return self._cached

    async def model(self, model_id: str) -> dict[str, Any] | None:
        return next((model for model in await self.models() if model["id"] == model_id), None)

    async def run(self, interval: float = REFRESH_SECONDS) -> None:
        """Learn the model names every `interval` (the first time is at start-up, in router.app)."""
        while True:
            await asyncio.sleep(interval)
            try:
                await self.learn_names()
            except Exception as exc:  # a bug of ours: never the end of the names learned
                self._unforeseen.log(exc, "learning the model names failed")

    async def learn_names(self) -> None:
        """Ask the backends for their models, for the names only (clients' list keeps its cache)."""
        self._learn({model["id"] for model in await self._fetch()})

    async def _fetch(self) -> list[dict[str, Any]]:
        answers = await asyncio.gather(*(self._list(b) for b in self._pools.backends()))
        seen: dict[str, dict[str, Any]] = {}
        for models in answers:
            for model in models:
                seen.setdefault(model["id"], model)
        self._learn(set(seen))
        return list(seen.values())

    def _learn(self, names: set[str]) -> None:
        """Remember new model names, at most MAX_KNOWN in all: an engine answering new names each
        time would otherwise grow the set, and the metrics' `model` label, without end."""
        room = self.MAX_KNOWN - len(self.known)
        if room > 0:
            self.known |= set(sorted(names - self.known)[:room])

    async def _list(self, backend: Backend) -> list[dict[str, Any]]:
        try:
            async with asyncio.timeout(self._timeout):
                status, body = await self._transport.get(backend.url + "/v1/models", headers=backend.auth_headers)
            data = json.loads(body).get("data", []) if status == 200 else []
        except (TransportError, TimeoutError, ValueError, AttributeError, RecursionError):
            # An unreachable backend contributes nothing (nor one whose JSON is nested past what
            # the parser recurses into); /readyz reports it.
            return []
        except Exception as exc:  # a library's or ours, an answer no check foresaw
            self._unforeseen.log(exc, "backend %s (pool %s): its model list failed", backend.name, backend.pool)
            return []
        if not isinstance(data, list):
            return []  # nor does one whose answer is no list of models, e.g. {"data": 5}
        return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
