"""The workers' shared figures over a Unix socket: `serve_figures` in the supervisor, and
`SocketStore`, the `Store` (router.replicas.store) each worker's `Replicas` calls.

One connection per worker, one JSON array a line each way, answered in order; a call is one
round trip, and the supervisor answers it without awaiting anything, so a claim for a backend's
last slot is granted to one worker. A worker's connection closing is its leaving.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from router.backends.engines import Elsewhere
from router.replicas.store import Ask, Claim, Claims, ClientShare, StoreError, View
from router.workers.figures import Figures

logger = logging.getLogger("specroute.workers")

_LINE_LIMIT = 64 * 1024 * 1024  # a sync of every client in flight on a worker fits
_LARGEST = 2**53


async def serve_figures(path: str, figures: Figures) -> asyncio.Server:
    """Answer the workers' calls on the Unix socket at `path`."""
    ids = itertools.count()

    async def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        worker = next(ids)
        figures.join(worker)
        try:
            while line := await reader.readline():
                writer.write(_answer(figures, worker, json.loads(line)))
        except (ConnectionError, ValueError, KeyError, TypeError, RecursionError, asyncio.LimitOverrunError) as exc:
            logger.error("shared figures: a worker's call failed, its connection is closed: %r", exc)
        finally:
            figures.leave(worker)
            writer.close()

    return await asyncio.start_unix_server(connected, path, limit=_LINE_LIMIT)


def _answer(figures: Figures, worker: int, call: list[Any]) -> bytes:
    match call:
        case [int() as id_, "client", str() as client, int() as here] if _counts(here):
            share = figures.client(worker, client, here=here)
            answer: list[Any] = [id_, share.in_flight, share.peak, _flat(share.backends)]
        case [int() as id_, "claim", list() as asks]:
            claims = figures.claim(worker, [_ask(ask) for ask in asks])
            answer = [id_, [[c.granted, c.in_flight, c.peak] for c in claims.claims], _flat(claims.backends)]
        case [int() as id_, "ended", dict() as clients, dict() as backends, dict() as unread, dict() as held] if (
            _counts(*clients.values(), *backends.values(), *unread.values(), *held.values())
        ):
            figures.ended(worker, clients, backends, unread, held)
            answer = [id_]
        case [int() as id_, "sync", dict() as clients, dict() as backends, dict() as held] if _counts(
            *clients.values(), *held.values()
        ):
            view = figures.sync(worker, clients, {name: _elsewhere(pair) for name, pair in backends.items()}, held)
            answer = [id_, view.replicas, _flat(view.backends)]
        case [int() as id_, "stats"]:
            answer = [id_, {"workers": figures.workers, "clients_remembered": figures.remembered}]
        case _:
            raise ValueError(f"a call out of shape: {str(call)[:80]}")
    return json.dumps(answer, separators=(",", ":")).encode() + b"\n"


def _counts(*values: Any) -> bool:
    """Whether each of a call's `values` is a count (of requests, slots, a change in them): an int
    a float holds exactly. A worker's figures are summed into the others' answers: a string there
    failed each of their calls, a NaN or a float went on to them."""
    return all(type(value) is int and -_LARGEST <= value <= _LARGEST for value in values)


def _ask(ask: Any) -> Ask:
    match ask:
        case [str() as backend, unread, limit, str() as client, here, bool() as hold] if _counts(unread, limit, here):
            return Ask(backend, unread, limit, client, here, hold)
    raise ValueError(f"an ask out of shape: {str(ask)[:80]}")


def _elsewhere(pair: Any) -> Elsewhere:
    match pair:
        case [in_flight, unread] if _counts(in_flight, unread):
            return Elsewhere(in_flight, unread)
    raise ValueError(f"a backend's figures out of shape: {str(pair)[:80]}")


def _flat(backends: Mapping[str, Elsewhere]) -> list[list[Any]]:
    return [[name, e.in_flight, e.unread] for name, e in backends.items()]


def _backends(flat: list[list[Any]]) -> dict[str, Elsewhere]:
    return {name: Elsewhere(n, u) for name, n, u in flat}


class SocketStore:
    """A worker's end: calls multiplexed on one connection, opened on first use and again after
    it broke (a call then fails with `StoreError`, and `Replicas` decides alone until a sync)."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task[None] | None = None
        self._waiting: dict[int, asyncio.Future[list[Any]]] = {}
        self._ids = itertools.count()

    async def client(self, client: str, *, here: int) -> ClientShare:
        match await self._call("client", client, here):
            case [int() as elsewhere, int() | float() as peak, list() as backends]:
                return ClientShare(elsewhere, float(peak), _backends(backends))
        raise StoreError("a client's figures out of shape")

    async def claim(self, asks: Sequence[Ask]) -> Claims:
        flat = [[a.backend, a.unread, a.limit, a.client, a.here, a.hold] for a in asks]
        match await self._call("claim", flat):
            case [list() as claims, list() as backends]:
                return Claims([Claim(bool(g), n, float(p)) for g, n, p in claims], _backends(backends))
        raise StoreError("a claim's answer out of shape")

    async def ended(
        self,
        clients: Mapping[str, int],
        backends: Mapping[str, int],
        unread: Mapping[str, int],
        held: Mapping[str, int] | None = None,
    ) -> None:
        await self._call("ended", dict(clients), dict(backends), dict(unread), dict(held or {}))

    async def sync(
        self, clients: Mapping[str, int], backends: Mapping[str, Elsewhere], held: Mapping[str, int] | None = None
    ) -> View:
        figures = {name: [e.in_flight, e.unread] for name, e in backends.items()}
        match await self._call("sync", dict(clients), figures, dict(held or {})):
            case [int() as replicas, list() as others]:
                return View(replicas, _backends(others))
        raise StoreError("a sync's answer out of shape")

    async def stats(self) -> dict[str, Any]:
        match await self._call("stats"):
            case [dict() as stats]:
                return stats
        raise StoreError("stats out of shape")

    async def aclose(self) -> None:
        if self._reading is not None:
            self._reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reading
        if self._writer is not None:
            self._writer.close()

    async def _call(self, *call: Any) -> list[Any]:
        if self._writer is None or self._writer.is_closing():
            await self._connect()
        assert self._writer is not None
        id_ = next(self._ids)
        answer: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        self._waiting[id_] = answer
        try:
            self._writer.write(json.dumps([id_, *call], separators=(",", ":")).encode() + b"\n")
            answered = await answer
            return answered[1:]
        finally:
            self._waiting.pop(id_, None)

    async def _connect(self) -> None:
        try:
            reader, self._writer = await asyncio.open_unix_connection(self._path, limit=_LINE_LIMIT)
        except OSError as exc:
            raise StoreError(f"the supervisor's socket: {exc}") from exc
        self._reading = asyncio.create_task(self._read(reader))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        why = "the supervisor closed the connection"
        try:
            while line := await reader.readline():
                answer = json.loads(line)
                waiting = self._waiting.get(answer[0])
                if waiting is not None and not waiting.done():
                    waiting.set_result(answer)
        except (ConnectionError, ValueError, IndexError, KeyError, TypeError, asyncio.LimitOverrunError) as exc:
            why = f"an answer out of shape: {exc!r}"[:200]
        finally:
            if self._writer is not None:
                self._writer.close()
            for waiting in self._waiting.values():
                if not waiting.done():
                    waiting.set_exception(StoreError(why))
