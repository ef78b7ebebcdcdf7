"""`Figures`: what the workers share, kept by the supervisor — the same answers as the replicas'
Redis scripts (router.replicas.redis), in one process's memory, with no I/O.

Each worker's figures are its own (clients in flight, slots in use, requests sent since its
reading); a call answers the sum over the other workers. A worker that leaves (its connection
closed: it ended or died) is forgotten at once. The client peaks are capped at `max_clients`,
the least recently raised dropped first, so a flood of distinct clients keeps memory bounded.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from router.backends.engines import Elsewhere
from router.replicas.store import Ask, Claim, Claims, ClientShare, View


@dataclass(slots=True)
class _Worker:
    clients: dict[str, int] = field(default_factory=dict)
    slots: dict[str, int] = field(default_factory=dict)
    unread: dict[str, int] = field(default_factory=dict)
    held: dict[str, int] = field(default_factory=dict)  # slots held idle (router.replicas.lease)

    def taken(self, backend: str) -> int:
        return self.slots.get(backend, 0) + self.held.get(backend, 0)


class Figures:
    def __init__(self, *, memory: float, max_clients: int, clock: Callable[[], float]) -> None:
        """`memory`: seconds in which a client's peak halves (classify.client_memory_seconds)."""
        self._memory = memory
        self._max_clients = max_clients
        self._clock = clock
        self._workers: dict[int, _Worker] = {}
        self._peaks: dict[str, tuple[float, float]] = {}  # client -> (peak, when); oldest raised first

    def join(self, worker: int) -> None:
        self._workers[worker] = _Worker()

    def leave(self, worker: int) -> None:
        self._workers.pop(worker, None)

    @property
    def workers(self) -> int:
        return len(self._workers)

    @property
    def remembered(self) -> int:
        """Client peaks held now (at most `max_clients`)."""
        return len(self._peaks)

    def client(self, worker: int, client: str, *, here: int) -> ClientShare:
        elsewhere, peak = self._client(worker, client, here)
        return ClientShare(elsewhere, peak, self._backends(worker))

    def claim(self, worker: int, asks: Sequence[Ask]) -> Claims:
        own = self._workers[worker]
        others = [w for i, w in self._workers.items() if i != worker]
        claims = []
        for ask in asks:
            granted = own.taken(ask.backend) + 1 + sum(w.taken(ask.backend) for w in others) <= ask.limit
            if granted:
                counts = own.held if ask.hold else own.slots
                counts[ask.backend] = counts.get(ask.backend, 0) + 1
                own.unread[ask.backend] = ask.unread
            claims.append(Claim(granted, *self._client(worker, ask.client, ask.here)))
        return Claims(claims, self._backends(worker))

    def ended(
        self,
        worker: int,
        clients: Mapping[str, int],
        backends: Mapping[str, int],
        unread: Mapping[str, int],
        held: Mapping[str, int] | None = None,
    ) -> None:
        """`clients`: their requests in flight on `worker` now; `backends`: slots ended there
        (less those taken from the held); `held`: the change in slots held."""
        own = self._workers[worker]
        for client, here in clients.items():
            _set(own.clients, client, here)
        for backend, ended in backends.items():
            _set(own.slots, backend, own.slots.get(backend, 0) - ended)
        own.unread.update(unread)
        for backend, change in (held or {}).items():
            _set(own.held, backend, own.held.get(backend, 0) + change)

    def sync(
        self,
        worker: int,
        clients: Mapping[str, int],
        backends: Mapping[str, Elsewhere],
        held: Mapping[str, int] | None = None,
    ) -> View:
        own = self._workers[worker]
        own.clients = {c: n for c, n in clients.items() if n > 0}
        own.slots = {b: e.in_flight for b, e in backends.items()}
        own.unread = {b: e.unread for b, e in backends.items()}
        own.held = {b: n for b, n in (held or {}).items() if n > 0}
        self._forget()
        return View(len(self._workers) - 1, self._backends(worker))

    def _client(self, worker: int, client: str, here: int) -> tuple[int, float]:
        """Set the client's requests on `worker`; its requests elsewhere and its peak."""
        _set(self._workers[worker].clients, client, here)
        elsewhere = sum(w.clients.get(client, 0) for i, w in self._workers.items() if i != worker)
        return elsewhere, self._peak(client, here + elsewhere)

    def _peak(self, client: str, total: int) -> float:
        if not self._memory:
            return 0.0
        now = self._clock()
        peak = self._faded(client, now)
        if total > 0 and total >= peak:
            peak = total
            self._peaks.pop(client, None)  # re-inserted last: the most recently raised
            self._peaks[client] = (total, now)
            while len(self._peaks) > self._max_clients:
                del self._peaks[next(iter(self._peaks))]
        return peak

    def _faded(self, client: str, now: float) -> float:
        if client not in self._peaks:
            return 0.0
        peak, when = self._peaks[client]
        return float(peak * 0.5 ** ((now - when) / self._memory))

    def _forget(self) -> None:
        """Peaks faded below half a request, from the oldest raised, a few per sync."""
        now = self._clock()
        for client in list(self._peaks)[:64]:
            if self._faded(client, now) >= 0.5:
                break
            del self._peaks[client]

    def _backends(self, worker: int) -> dict[str, Elsewhere]:
        sums: dict[str, Elsewhere] = {}
        for i, w in self._workers.items():
            if i == worker:
                continue
            for name in w.slots.keys() | w.unread.keys():
                seen = sums.get(name, Elsewhere(0, 0))
                sums[name] = Elsewhere(seen.in_flight + w.slots.get(name, 0), seen.unread + w.unread.get(name, 0))
        return sums


def _set(table: dict[str, int], key: str, count: int) -> None:
    if count > 0:
        table[key] = count
    else:
        table.pop(key, None)
