"""Who is a client, and what it did lately: the memory that feeds classification's heuristic.

A client is the combination of what its requests carry (`client_id`); `Clients` counts each
one's requests in flight and remembers its recent peak, so a batch job is still one when its
next burst begins. With replicas sharing state (router.replicas), what the others have of a
client in flight, and the peak they remember, count as well.
"""

from __future__ import annotations

import asyncio
import fnmatch
import hashlib
import logging
from collections.abc import Mapping

from router.clock import Clock
from router.config import Classify

logger = logging.getLogger("specroute")


def client_id(api_key: str | None, user: str | None, address: str | None) -> str:
    """Who a request belongs to, for fair share, limits and the in-flight heuristic: the
    combination of what is present.

    `api_key` is an identity unless it is a placeholder (the caller passes None then, see
    `Placeholders`: "none" tells nobody apart); it is kept only as a hash. Users sharing one key
    are told apart by the body's `user`; everyone behind one address, by their key or `user`.
    The `user` is kept as a hash too: the body's any length, every table keyed by client small.
    """
    parts = [f"key:{key_hash(api_key)}"] if api_key else []
    if user:
        parts.append(f"user:{key_hash(user)}")
    parts.append(f"addr:{address or 'unknown'}")
    return " ".join(parts)


def key_hash(api_key: str) -> str:
    """An API key (or a `user`) as the router keeps it: 16 hex digits of its BLAKE2b digest."""
    return hashlib.blake2b(api_key.encode(), digest_size=8).hexdigest()


class Placeholders:
    """The bearer keys that say nothing about who sends them (`classify.placeholder_keys`):
    shell-style patterns, compared without regard to case."""

    def __init__(self, patterns: list[str]) -> None:
        self._patterns = tuple(pattern.lower() for pattern in patterns)

    def __contains__(self, key: str) -> bool:
        key = key.strip().lower()
        return not key or any(fnmatch.fnmatchcase(key, pattern) for pattern in self._patterns)


class ProxyNotice:
    """A warning, once per peer, for requests that arrive through a proxy the router does not
    trust (`listen.forwarded_allow_ips`): all its users then count as one client, the proxy."""

    _MAX = 256  # peers remembered; past them, no more warnings

    def __init__(self) -> None:
        self._warned: set[str] = set()

    def check(self, address: str | None, forwarded_for: str | None) -> None:
        if forwarded_for is None or address is None or address in self._warned or len(self._warned) >= self._MAX:
            return
        # A trusted proxy's header was taken: the client's address is then one of those it names.
        if address in (part.strip() for part in forwarded_for.split(",")):
            return
        self._warned.add(address)
        logger.warning(
            "requests from %s carry X-Forwarded-For, but %s is not in listen.forwarded_allow_ips: "
            "every client behind it counts as one (fair share, limits, batch detection)",
            address,
            address,
        )


class Clients:
    """Requests in flight per client, and a fading memory of each client's recent peak.

    A batch job that was running a hundred requests a moment ago is still a batch job when its
    next burst begins: `load()` is the larger of what the client has in flight now and its past
    peak, halved every `memory` seconds.
    """

    _PURGE_AT = 10_000  # forget faded clients once this many are remembered

    def __init__(self, *, clock: Clock) -> None:
        self._clock = clock
        self._memory = self._burst_hold = 0.0
        self._threshold = 4
        self._in_flight: dict[str, int] = {}
        self._elsewhere: dict[str, int] = {}  # the other replicas' requests in flight, of clients here
        self._peaks: dict[str, tuple[float, float]] = {}  # client -> (peak, when)
        self._holds: dict[str, asyncio.Event] = {}  # clients whose first requests are held
        self.proxies = ProxyNotice()

    def configure(self, config: Classify) -> None:
        self._memory = config.client_memory_seconds
        self._burst_hold = config.burst_hold_seconds
        self._threshold = config.batch_inflight_threshold

    async def settle(self, client: str, *, new: bool) -> bool:
        """Hold the first requests of a client not seen lately (`new`, from `start`), for at most
        `burst_hold` seconds or until more than `threshold` of them are here: a batch job's first
        burst then shows itself before any of it is classified, and an interactive user's first
        request waits that long (its later ones, not at all). True if it was held."""
        hold = self._holds.get(client)
        if hold is None:
            if not new or not self._burst_hold:
                return False
            hold = self._holds[client] = asyncio.Event()
        try:
            async with asyncio.timeout(self._burst_hold):
                await hold.wait()
        except TimeoutError:
            pass
        finally:
            if self._holds.get(client) is hold:
                del self._holds[client]
                hold.set()  # the hold ends for everyone waiting on it
        return True

    def counts(self) -> Mapping[str, int]:
        """Requests in flight here, per client (only clients with some)."""
        return self._in_flight

    def __getitem__(self, client: str) -> int:
        return self._in_flight.get(client, 0)

    def load(self, client: str) -> float:
        return max(self[client] + self._elsewhere.get(client, 0), self._remembered(client, self._clock.now()))

    def share(self, client: str, *, elsewhere: int, peak: float) -> None:
        """What the other replicas have of a client with requests here: its requests in flight
        there, and its peak across all replicas (faded to now). A burst split between replicas
        ends the hold once it is larger than the threshold in all."""
        if client not in self._in_flight:
            return  # its requests here have ended meanwhile
        self._elsewhere[client] = elsewhere
        now = self._clock.now()
        peak = max(peak, self._in_flight[client] + elsewhere)
        if self._memory and peak >= self._remembered(client, now):
            if client not in self._peaks and len(self._peaks) >= self._PURGE_AT:
                self._purge(now)
            self._peaks[client] = (peak, now)
        if self._in_flight[client] + elsewhere > self._threshold and client in self._holds:
            self._holds[client].set()

    def alone(self) -> None:
        """The other replicas' figures are no longer known: from now on, this replica's own."""
        self._elsewhere.clear()

    def start(self, client: str) -> bool:
        """Count a request in flight. True if it is the first of a client not seen lately: none of
        its requests in flight, and its remembered peak faded below half a request (for a user
        with one request at a time, none for `memory` seconds)."""
        now = self._clock.now()
        count = self._in_flight.get(client, 0) + 1
        new = count == 1 and self._remembered(client, now) < 0.5
        self._in_flight[client] = count
        if new and self._burst_hold and client not in self._holds:
            # Held from now, not from `settle`: its next request may come before this one settles.
            self._holds[client] = asyncio.Event()
        if count > self._threshold and client in self._holds:
            self._holds[client].set()  # enough of a burst: classify them all now
        if self._memory and count >= self._remembered(client, now):
            if len(self._peaks) >= self._PURGE_AT:
                self._purge(now)
            self._peaks[client] = (count, now)
        return new

    def finish(self, client: str) -> None:
        left = self._in_flight[client] - 1
        if left:
            self._in_flight[client] = left
        else:
            del self._in_flight[client]
            self._elsewhere.pop(client, None)
            hold = self._holds.pop(client, None)
            if hold is not None:
                hold.set()  # none of its requests left to hold

    def _remembered(self, client: str, now: float) -> float:
        if not self._memory or client not in self._peaks:
            return 0.0
        peak, when = self._peaks[client]
        return float(peak * 0.5 ** ((now - when) / self._memory))

    def _purge(self, now: float) -> None:
        """Forget faded clients; if a flood of live ones leaves more than half the cap, the least
        recently seen of those idle too: memory stays bounded, and a purge runs once per many."""
        idle = [c for c in self._peaks if c not in self._in_flight]
        for client in [c for c in idle if self._remembered(c, now) < 1]:
            del self._peaks[client]
        excess = len(self._peaks) - self._PURGE_AT // 2
        if excess > 0:
            for client in sorted((c for c in idle if c in self._peaks), key=lambda c: self._peaks[c][1])[:excess]:
                del self._peaks[client]
