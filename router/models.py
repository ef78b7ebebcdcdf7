"""`GET /v1/models`: the union of every backend's models, cached briefly."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from router.pools import Backend, Pools


class ModelCatalog:
    def __init__(self, pools: Pools, http: httpx.AsyncClient, *, ttl: float, timeout: float) -> None:
        self._pools = pools
        self._http = http
        self._ttl = ttl
        self._timeout = timeout
        self._cached: list[dict[str, Any]] | None = None
        self._fetched_at = 0.0
        self._lock = asyncio.Lock()

    async def models(self) -> list[dict[str, Any]]:
        async with self._lock:  # one refresh at a time; the others take its result
            if self._cached is None or time.monotonic() - self._fetched_at > self._ttl:
                self._cached = await self._fetch()
                self._fetched_at = time.monotonic()
            return self._cached

    async def _fetch(self) -> list[dict[str, Any]]:
        answers = await asyncio.gather(*(self._list(b) for b in self._pools.backends()))
        seen: dict[str, dict[str, Any]] = {}
        for models in answers:
            for model in models:
                seen.setdefault(model["id"], model)
        return list(seen.values())

    async def _list(self, backend: Backend) -> list[dict[str, Any]]:
        headers = {"authorization": f"Bearer {backend.api_key}"} if backend.api_key else {}
        try:
            response = await self._http.get(backend.url + "/v1/models", headers=headers, timeout=self._timeout)
            data = response.json().get("data", []) if response.status_code == 200 else []
        except (httpx.HTTPError, ValueError, AttributeError):
            return []  # an unreachable backend contributes nothing; /readyz reports it
        return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
