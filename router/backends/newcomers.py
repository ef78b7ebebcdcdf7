"""Room over the cap for a client holding no slot (`fairness.newcomer_slots`).

The fair order and the room kept for active clients (router.backends.share) act on the clients
a pool has seen. A client that took every slot before another asked (an agent's burst in the
same second as a chat user's first question) makes the newcomer wait for one of its requests to
end, however fair the queue. So an interactive request whose client holds no slot in the pool
may go past a backend's `max_concurrency`, by at most `slots` requests on that backend, when:

- the engine's last fresh reading shows KV room for it: its usage, projected with the requests
  sent since and this one (router.backends.engines), stays below `routing.kv_threshold`; an
  engine that states nothing of its KV cache, or whose reading is stale, takes no one over its cap;
- no other replica uses the backend (router.replicas): their shared count knows only the cap.

The requests over the cap are not marked: they are the backend's requests past
`max_concurrency`, whoever sent them, so none is taken back over the cap when one below it ends,
and the backend is back at its cap as soon as enough of them end. A flood of distinct clients,
each holding none, gets at most `slots` more requests on each backend, never one each.
"""

from __future__ import annotations

from collections.abc import Iterable

from router.backends.backend import Backend
from router.config import Fairness, Routing, Scrape


class Newcomers:
    """How far a pool's backends may go past their cap for clients holding no slot."""

    def __init__(self) -> None:
        self.slots = 0  # requests over max_concurrency a backend may run for them (0: none)
        self.kv_threshold = 0.9  # routing.kv_threshold
        self.stale_after = 5.0  # scrape.stale_after
        self.admitted = 0  # requests admitted over a backend's cap, ever

    def configure(self, fairness: Fairness, routing: Routing, scrape: Scrape) -> None:
        self.slots = fairness.newcomer_slots
        self.kv_threshold, self.stale_after = routing.kv_threshold, scrape.stale_after

    def backend(
        self, backends: Iterable[Backend], now: float, *, tokens: int | None, only: str | None
    ) -> Backend | None:
        """The emptiest backend that may take one more request over its cap now, if any."""
        if self.slots <= 0:
            return None
        candidates = [b for b in backends if (only is None or b.name == only) and self._has_room(b, now, tokens)]
        if not candidates:
            return None
        backend = min(candidates, key=lambda b: b.load)
        backend.in_flight += 1
        backend.sent += 1
        self.admitted += 1
        return backend

    def _has_room(self, backend: Backend, now: float, tokens: int | None) -> bool:
        over = backend.in_flight >= backend.max_concurrency + self.slots
        if over or not backend.accepting or backend.elsewhere.in_flight:
            return False
        if not backend.engine.reading.fresh(now, self.stale_after):
            return False
        kv = backend.kv_projected(now, self.stale_after, tokens)
        return kv is not None and kv < self.kv_threshold
