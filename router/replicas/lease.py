"""`Leases`: slots a replica claims from the store ahead of its requests, so that a request
usually takes one without a round trip.

A slot held is claimed in the store like one in use: the other replicas count it, so the
replicas together never hold more than a backend's `max_concurrency` and nothing is
over-committed. What a replica holds idle is room the others cannot take: at most `size` slots
per backend, and at most its share of the room left free, `room // replicas`; past that it gives
the rest back. A slot that ends goes back to what is held, up to that target, without a word to
the store; one taken is claimed again behind the request. Only backends this replica sent a
request to lately are held: `idle` seconds without one, and it gives theirs back.
"""

from __future__ import annotations

from collections.abc import Iterable

from router.backends.backend import Backend


class Leases:
    def __init__(self, *, size: int, idle: float) -> None:
        self._size = size
        self._idle = idle
        self._held: dict[str, int] = {}  # backend -> slots claimed in the store, idle here
        self._target: dict[str, int] = {}  # backend -> what to hold, from the last figures
        self._used: dict[str, float] = {}  # backend -> when a request last took a slot there

    def take(self, backend: str, now: float) -> bool:
        """A slot held on `backend`, for a request: True if there was one."""
        if self._size:
            self._used[backend] = now
        held = self._held.get(backend, 0)
        if not held:
            return False
        self._held[backend] = held - 1
        return True

    def keep(self, backend: str) -> bool:
        """A slot on `backend` ended: True if it is held again (else it goes back to the store)."""
        held = self._held.get(backend, 0)
        if held >= self._target.get(backend, 0):
            return False
        self._held[backend] = held + 1
        return True

    def granted(self, backend: str) -> None:
        """The store granted a slot asked for by `wanted`."""
        self._held[backend] = self._held.get(backend, 0) + 1

    def held(self, backend: str) -> int:
        return self._held.get(backend, 0)

    def holding(self) -> dict[str, int]:
        return {name: held for name, held in self._held.items() if held}

    def wanted(self) -> dict[str, int]:
        """The slots to claim, per backend, to hold each target again once half of it is in use
        (a slot that ends is held again: a replica's steady traffic asks for none)."""
        wanted = {}
        for name, target in self._target.items():
            if (held := self.held(name)) < target and held <= target // 2:
                wanted[name] = target - held
        return wanted

    def rebalance(self, backends: Iterable[Backend], others: int, now: float) -> dict[str, int]:
        """Each backend's target from the figures now (its room: slots not in use here or on
        the others, those held here included); answers the slots to give back, no longer held."""
        back: dict[str, int] = {}
        present = {backend.name: backend for backend in backends}
        for name in list(self._used.keys() | self._target.keys()):
            backend = present.get(name)
            if backend is None or now - self._used.get(name, -float("inf")) > self._idle:
                self._used.pop(name, None)  # gone, or not used lately: hold nothing there
                target = 0
            else:
                room = backend.max_concurrency - backend.in_flight - backend.elsewhere.in_flight
                target = max(0, min(self._size, room // (others + 1)))
            if (excess := self.held(name) - target) > 0:
                back[name] = excess
            if target or name in self._used:
                self._target[name], self._held[name] = target, min(target, self.held(name))
            else:  # bounded: only backends used lately are kept
                self._target.pop(name, None)
                self._held.pop(name, None)
        return back

    def clear(self) -> None:
        """The store failed: what it held for this replica is void (the next sync rewrites it)."""
        self._held.clear()
        self._target.clear()
