"""`Peers`: the other workers, reached on their private Unix sockets, so that one scrape, one
status and one admin call speak for all of them, whichever worker the kernel gave it to.

A request that came in on a private socket is answered by that worker alone (`public` is false
for it): a worker never asks the others on behalf of another worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from starlette.requests import Request

from router.replicas.store import Store, StoreError
from router.workers.store import SocketStore

logger = logging.getLogger("specroute.workers")

_TIMEOUT = aiohttp.ClientTimeout(total=5)  # a worker busy with a reload or a full event loop answers within it


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: bytes


class Peers:
    def __init__(self, *, index: int, count: int, rundir: Path) -> None:
        self.index = index
        self.count = count
        self._rundir = rundir
        # The same in every worker of one supervisor: the router's name in a `Via` (router.runtime).
        self.identity = hashlib.blake2b(str(rundir).encode(), digest_size=8).hexdigest()
        self._sessions: dict[int, aiohttp.ClientSession] = {}

    def path(self, index: int) -> Path:
        return self._rundir / f"worker-{index}.sock"

    @staticmethod
    def public(request: Request) -> bool:
        """Whether the request came in on the shared port (uvicorn gives a Unix socket's
        connection its path and no port)."""
        server = request.scope.get("server")
        return server is not None and server[1] is not None

    async def ask(
        self, method: str, path: str, *, headers: Mapping[str, str] | None = None, body: bytes = b""
    ) -> list[Answer]:
        """The same request to every other worker; the answers of those that gave one (a worker
        being restarted does not)."""
        answers = await asyncio.gather(
            *(self._ask(index, method, path, headers, body) for index in range(self.count) if index != self.index)
        )
        return [answer for answer in answers if answer is not None]

    async def _ask(
        self, index: int, method: str, path: str, headers: Mapping[str, str] | None, body: bytes
    ) -> Answer | None:
        session = self._sessions.get(index)
        if session is None:
            connector = aiohttp.UnixConnector(path=str(self.path(index)))
            session = self._sessions[index] = aiohttp.ClientSession(connector=connector, timeout=_TIMEOUT)
        try:
            async with session.request(method, "http://worker" + path, headers=headers, data=body) as response:
                return Answer(response.status, await response.read())
        except (aiohttp.ClientError, TimeoutError) as exc:
            logger.warning("worker %d did not answer %s %s: %r", index, method, path, exc)
            return None

    async def aclose(self) -> None:
        for session in self._sessions.values():
            await session.close()

    def summary(self, answered: int) -> dict[str, Any]:
        """What an answer that speaks for all the workers says of them."""
        return {"this": self.index, "count": self.count, "answered": answered + 1}

    async def status(self, view: dict[str, Any], store: Store | None) -> dict[str, Any]:
        """This worker's /router/status with the others' requests in flight and queued added in,
        and the workers' own figures (the shared client memory's size)."""
        asked = await self.ask("GET", "/router/status")
        answers = [json.loads(answer.body) for answer in asked if answer.status == 200]
        for other in answers:
            for name, pool in view["pools"].items():
                theirs = other["pools"].get(name)
                if theirs is None:
                    continue
                pool["in_flight"] += theirs["in_flight"]
                for job in pool["queued"]:
                    pool["queued"][job] += theirs["queued"].get(job, 0)
                for backend, figures in pool["backends"].items():
                    figures["in_flight"] += theirs["backends"].get(backend, {}).get("in_flight", 0)
        summary = self.summary(len(answers))
        if isinstance(store, SocketStore):
            with contextlib.suppress(StoreError):
                summary["shared"] = await store.stats()
        return {**view, "workers": summary}
