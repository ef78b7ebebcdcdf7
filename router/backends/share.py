"""Room kept on a contended pool for the clients that ask little (`fairness.keep_room`).

A fair queue (router.backends.pools) can only hand over a slot once one frees: a client that
holds them all makes a newcomer wait for one of its requests to end. So while other clients are
active on a pool, a client holding at least its share of the slots (the pool's slots times its
weight over the active clients' weights) takes one more only if that leaves a slot free for
each other active client holding none. Alone, a client takes every slot.

A client is active while it holds a slot, and for `fairness.active_window` seconds after it last
asked for or gave back one. At most `LIMIT` clients are remembered per pool, the least recently
active forgotten first: a flood of distinct keys costs bounded memory and O(1) per request.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

from router.clock import Clock

LIMIT = 10_000


class Activity:
    """The clients active on one pool lately, with their weights."""

    def __init__(self, clock: Clock, *, limit: int = LIMIT) -> None:
        self.clock = clock
        self.limit = limit
        self.keep_room = True
        self.window = 30.0
        self._seen: OrderedDict[str, tuple[float, float]] = OrderedDict()  # client -> (when, weight), oldest first
        self._weights = 0.0

    def __len__(self) -> int:
        return len(self._seen)

    def seen(self, client: str, weight: float) -> None:
        """`client` asked for a slot now."""
        self._forget(client)
        self._seen[client] = (self.clock.now(), weight)
        self._weights += weight
        while len(self._seen) > self.limit:
            self._forget(next(iter(self._seen)))

    def gave_back(self, client: str) -> None:
        """`client` gave back a slot now: its window starts again."""
        entry = self._seen.get(client)
        if entry is not None:
            self.seen(client, entry[1])

    def prune(self, held: Mapping[str, int]) -> float | None:
        """Forget the clients inactive for `window` seconds (one holding a slot stays active).
        Returns the clock's time when the next one will be, if any."""
        now = self.clock.now()
        while self._seen:
            client, (when, weight) = next(iter(self._seen.items()))
            if now - when < self.window:
                return when + self.window
            if client in held:
                self.seen(client, weight)
            else:
                self._forget(client)
        return None

    def must_wait(self, client: str, weight: float, held: Mapping[str, int], *, free: int, capacity: int) -> bool:
        """Whether `client` (already `seen`) must leave the pool's `free` slots to others now."""
        mine = held.get(client, 0)
        if not self.keep_room or capacity <= 0 or mine < capacity * weight / max(self._weights, weight):
            return False
        # It holds a slot (its share is above 0), so it is one of the holders counted here.
        idle = len(self._seen) - sum(1 for other in held if other in self._seen)
        return 0 < free <= idle

    def _forget(self, client: str) -> None:
        entry = self._seen.pop(client, None)
        if entry is not None:
            self._weights = self._weights - entry[1] if self._seen else 0.0
