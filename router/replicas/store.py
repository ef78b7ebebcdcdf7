"""The interface of a store that replicas share, and what it answers.

A store keeps, for each replica, its own figures (a client's requests in flight, a backend's
slots in use and requests sent since the replica's last reading of it), and answers with the
sum of the other live replicas' figures. A client's count is written whole with each call that
concerns it; slots are counted as they are taken and end; `sync` writes everything whole, which
repairs a count lost or doubled by a call that ran out of time. A store raises `StoreError`
for anything that goes wrong, whatever its cause (a connection lost, an answer that is not
what was asked); `Replicas` (router.replicas.shared) bounds each call in time and falls back to
the replica's own view.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from router.backends.engines import Elsewhere


class StoreError(Exception):
    """The store did not answer as it should (unreachable, refused, or an answer out of shape)."""


@dataclass(frozen=True, slots=True)
class ClientShare:
    """A client as the other replicas see it, and the backends' figures elsewhere."""

    in_flight: int  # the client's requests in flight on the other replicas
    peak: float  # its remembered peak across all replicas, faded to now
    backends: Mapping[str, Elsewhere]


@dataclass(frozen=True, slots=True)
class View:
    """What a sync answers: the other live replicas, and the backends' figures on them."""

    replicas: int
    backends: Mapping[str, Elsewhere]


@dataclass(frozen=True, slots=True)
class Ask:
    """A slot asked for on `backend` by a request of `client`."""

    backend: str
    unread: int  # this replica's requests there sent since its last reading of the engine
    limit: int  # the slots of the backend, for the replicas together
    client: str
    here: int  # the client's requests in flight on this replica
    hold: bool = False  # a slot to hold for the replica's next requests (router.replicas.lease)


@dataclass(frozen=True, slots=True)
class Claim:
    granted: bool  # the slot was free across all replicas, and is now this replica's
    in_flight: int  # the client's requests in flight on the other replicas
    peak: float  # its remembered peak across all replicas, faded to now


@dataclass(frozen=True, slots=True)
class Claims:
    """What a round of claims answers: each claim in the order asked, and the backends' figures
    on the other replicas."""

    claims: Sequence[Claim]
    backends: Mapping[str, Elsewhere]


class Store(Protocol):
    """A sharing mechanism between replicas (Redis; another process's, for worker processes)."""

    async def client(self, client: str, *, here: int) -> ClientShare:
        """`client` (an opaque, bounded id) has `here` requests in flight on this replica: write
        it, fold the client's total into its shared peak, and answer the others' figures."""
        ...

    async def claim(self, asks: Sequence[Ask]) -> Claims:
        """Slots, each granted, and counted, only if the replicas together then hold at most its
        `limit`; and each asking client's figures written and answered as `client` does."""
        ...

    async def ended(
        self,
        clients: Mapping[str, int],
        backends: Mapping[str, int],
        unread: Mapping[str, int],
        held: Mapping[str, int] | None = None,
    ) -> None:
        """Clients' requests in flight here now, slots that ended here per backend (less those
        taken from the held ones), those backends' `unread` now, and the change in slots held."""
        ...

    async def sync(
        self, clients: Mapping[str, int], backends: Mapping[str, Elsewhere], held: Mapping[str, int] | None = None
    ) -> View:
        """All of this replica's figures (`held`: its slots held idle, per backend), replacing
        what the store had of it (and keeping it alive there); answers what the other replicas
        have."""
        ...

    async def aclose(self) -> None: ...
