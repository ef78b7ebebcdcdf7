"""Finding the backend that holds a stored response this router does not remember.

What router.affinity remembers is one replica's memory: another replica made the response, or
this one restarted. Before routing such a request as usual (to an engine that may never have
stored it, and answers 404), the router asks the healthy backends `GET /v1/responses/{id}`, all
at once; the first to answer 200 holds it. vLLM answers 404 for an id it does not hold (and
holds none unless it runs with `VLLM_ENABLE_RESPONSES_API_STORE=1`), so a miss costs one
dictionary lookup on each engine.

The cost is bounded three ways: each search ends after `locate_timeout`; at most
`locate_concurrency` searches run at once (past that a request is routed as usual without
one), and requests naming the same id share one search; an id nobody held is not asked about
again for `locate_miss_seconds` (at most `_MISSES_MAX` ids). Nothing a probe receives reaches
the client: only which backend answered 200.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Literal

from router.backends.backend import Backend
from router.config import Responses
from router.responses.affinity import RESPONSE_ID
from router.transport import HeadLimits, Timeouts, Transport, TransportError

# Ids found nowhere that are remembered as such, at most (the oldest go first).
_MISSES_MAX = 10_000
# A probe's answer is read only to keep its connection; a larger one is closed instead.
_PROBE_BODY_BYTES = 64 * 1024
_PROBE_LIMITS = HeadLimits(head_bytes=64 * 1024, headers=100)

Found = Literal["found", "missed", "cached_miss", "busy", "skipped"]


class Locator:
    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        # (id, digest of the credentials) -> until when it is a known miss: with the client's
        # Authorization forwarded, an engine may answer 404 to one tenant for an id another holds.
        # A digest: an Authorization is any client's up to the request head's size.
        self._misses: OrderedDict[tuple[str, bytes], float] = OrderedDict()
        # (id, digest of the credentials) -> the search under way: (the owner or None, whether all said 404)
        self._searching: dict[tuple[str, bytes], asyncio.Future[tuple[str | None, bool]]] = {}
        self.configure(Responses())

    def configure(self, config: Responses) -> None:
        self.timeout = config.locate_timeout
        self.concurrency = config.locate_concurrency
        self.miss_seconds = config.locate_miss_seconds

    async def locate(
        self,
        response_id: str,
        backends: Sequence[Backend],
        headers: Callable[[Backend], list[tuple[str, str]]],
        *,
        credentials: str,
        now: float,
    ) -> tuple[str | None, Found]:
        """The name of the backend that holds `response_id`, if one of `backends` does, and how
        that was settled. `headers(backend)`: what the request itself would carry there; requests
        share a search only with those of the same `credentials` (the client's Authorization)."""
        if self.timeout <= 0 or not backends or RESPONSE_ID.fullmatch(response_id) is None:
            return None, "skipped"
        key = (response_id, hashlib.blake2b(credentials.encode(), digest_size=16).digest())
        until = self._misses.get(key)
        if until is not None:
            if until > now:
                return None, "cached_miss"
            del self._misses[key]
        search = self._searching.get(key)
        if search is None:
            if len(self._searching) >= self.concurrency:
                return None, "busy"
            # A task of its own: a client that leaves does not end the search others wait on.
            search = asyncio.ensure_future(self._search(response_id, backends, headers))
            self._searching[key] = search
            search.add_done_callback(lambda done: self._searched(key, done, now))
        owner, _ = await asyncio.shield(search)
        return owner, "found" if owner is not None else "missed"

    def _searched(self, key: tuple[str, bytes], search: asyncio.Future[tuple[str | None, bool]], now: float) -> None:
        del self._searching[key]
        if not search.cancelled() and search.exception() is None:
            owner, nowhere = search.result()
            if owner is None and nowhere:
                self._miss(key, now)

    async def _search(
        self, response_id: str, backends: Sequence[Backend], headers: Callable[[Backend], list[tuple[str, str]]]
    ) -> tuple[str | None, bool]:
        """(the backend that answered 200, or None; whether every backend answered 404)."""
        target = f"/v1/responses/{response_id}"
        timeouts = Timeouts(connect=self.timeout, read=self.timeout, idle=self.timeout)

        async def probe(backend: Backend) -> tuple[int, str]:
            """The backend's status for the id (0 if it gave none), and its name."""
            try:
                response = await self._transport.request(
                    backend.url, target, method="GET", headers=headers(backend), timeouts=timeouts, limits=_PROBE_LIMITS
                )
            except TransportError:
                return 0, backend.name
            try:
                with contextlib.suppress(TransportError):
                    await response.read(limit=_PROBE_BODY_BYTES)  # to keep the connection, if small
            finally:
                await response.aclose()
            return response.status, backend.name

        probes = [asyncio.ensure_future(probe(backend)) for backend in backends]
        absent = 0
        try:
            async with asyncio.timeout(self.timeout):
                for done in asyncio.as_completed(probes):
                    status, name = await done
                    if status == 200:
                        return name, False
                    absent += status == 404
        except TimeoutError:
            pass
        finally:
            for task in probes:
                task.cancel()
            await asyncio.gather(*probes, return_exceptions=True)
        return None, absent == len(probes)

    def _miss(self, key: tuple[str, bytes], now: float) -> None:
        if self.miss_seconds <= 0:
            return
        self._misses[key] = now + self.miss_seconds
        self._misses.move_to_end(key)
        while len(self._misses) > _MISSES_MAX or next(iter(self._misses.values())) <= now:
            self._misses.popitem(last=False)
