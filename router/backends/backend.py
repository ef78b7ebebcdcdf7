"""A backend: the router's slots on one engine, with its parts of other concerns kept apart.

`outlier` (health and ejection, router.backends.outlier), `engine` (what the engine says of its
load, router.backends.engines), `first_tokens` (streams waiting for theirs, recent first-token
times), `elsewhere` (its figures on the other replicas, router.replicas). A backend found by name
(router.backends.discovery) has its `address`.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from router.backends.engines import ALONE, Elsewhere, EngineView
from router.backends.outlier import Outlier
from router.config import Backend as BackendConfig


class FirstTokens:
    """Streams sent to a backend that have no first token yet, and its recent first-token times.

    A stream may come with the seconds its prompt's uncached part is predicted to take to prefill
    there (conversations priced, router.routing.snapshot). An engine prefills the prompts it was
    sent one after another, so they queue: the next one's first token comes after what is predicted
    left of that queue, its own prefill, and the least that recent first tokens took beyond their
    predicted prefill (the queue ahead of them and their own): the rest of a first token's time
    there (the least: one mispredicted burst does not make the engine look slow afterwards).
    """

    def __init__(self) -> None:
        self.recent: deque[float] = deque(maxlen=256)
        self._beyond: deque[float] = deque(maxlen=8)
        self._least: float | None = None  # their least, kept: read for every request routed
        self._waiting: dict[object, tuple[float, float]] = {}  # a token of each stream -> sent at, prefilled by
        self._prefilled_by = -math.inf  # when the prompts sent so far are predicted prefilled

    def waiting(self, token: object, now: float, prefill: float = 0.0) -> None:
        self._prefilled_by = max(now, self._prefilled_by) + prefill
        self._waiting[token] = (now, self._prefilled_by)

    def arrived(self, token: object, ttft: float) -> None:
        """A stream's first token arrived (`ttft` seconds after it reached the router)."""
        sent = self._waiting.pop(token, None)
        if sent is not None:
            self.recent.append(ttft)
            self._beyond.append(max(0.0, ttft - (sent[1] - sent[0])))
            self._least = min(self._beyond)

    def forget(self, token: object) -> None:
        self._waiting.pop(token, None)

    def oldest_wait(self, now: float) -> float:
        """Seconds the oldest stream sent here has waited without a first token (0: none waits)."""
        return now - min(sent for sent, _ in self._waiting.values()) if self._waiting else 0.0

    @property
    def overhead(self) -> float | None:
        """The least a recent first token took beyond its predicted prefill (None: none measured)."""
        return self._least

    def predicted(self, now: float, prefill: float, unmeasured: float = 0.0, *, ahead: float | None = None) -> float:
        """The first token of a stream sent now whose own prefill takes `prefill` seconds; until
        a first token here is measured, its overhead taken as `unmeasured`. `ahead`: `ahead(now)`,
        where read already."""
        overhead = self.overhead
        ahead = self.ahead(now) if ahead is None else ahead
        return (unmeasured if overhead is None else overhead) + ahead + prefill

    def ahead(self, now: float) -> float:
        """Seconds of prefill predicted ahead of a prompt sent now: what is left of the prompts
        sent here, and, if a stream still waiting is later than the overhead past its predicted
        prefill, that much more (the engine runs late)."""
        # The oldest stream waiting was predicted prefilled first: it is the latest, if any is.
        oldest = next(iter(self._waiting.values()), None)
        late = 0.0 if oldest is None else now - oldest[1] - (self._least or 0.0)
        return max(0.0, self._prefilled_by - now) + max(0.0, late)


@dataclass(frozen=True, slots=True)
class Address:
    """An engine's IP address and port, as a name resolved (router.backends.discovery)."""

    host: str
    port: int

    @property
    def netloc(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


class Backend:
    def __init__(
        self,
        name: str,
        pool: str,
        config: BackendConfig,
        *,
        url: str | None = None,
        found_by: str | None = None,
        address: Address | None = None,
    ) -> None:
        """A backend found by name (router.backends.discovery) has its `url` at one `address`
        the configured backend `found_by` resolved to; it takes no work until a health check passes."""
        self.name = name
        self.pool = pool
        self.url = url or config.url
        self.found_by = found_by
        self.found_as = (config.url, config.discover) if found_by is not None else None
        self.address = address
        self.api_key = config.api_key()
        self.max_concurrency = config.max_concurrency
        self.in_flight = 0
        # The tokens each of its requests in flight holds at its end (router.content), where
        # known, by a token of the request: for the KV they take (router.backends.engines).
        self.holding: dict[object, int] = {}
        self.batch_work: set[object] = set()  # its batch requests in flight, by the same token
        self.elsewhere: Elsewhere = ALONE  # its figures on the other replicas (router.replicas)
        self.sent = 0  # requests it was ever given a slot for
        self.draining = False  # set by an operator: no new work, running requests finish
        self.gone = False  # found by name, and the name no longer resolves to it: drained until removed
        self.outlier = Outlier(name, pool, healthy=found_by is None)
        self.engine = EngineView()
        self.first_tokens = FirstTokens()

    def configure(self, config: BackendConfig) -> None:
        """A reloaded configuration for the same backend (same name and URL)."""
        self.api_key = config.api_key()
        self.max_concurrency = config.max_concurrency

    @property
    def healthy(self) -> bool:
        return self.outlier.healthy

    @property
    def accepting(self) -> bool:
        """Whether new work may go here: healthy and not being drained."""
        return self.outlier.healthy and not self.draining and not self.gone

    @property
    def slots_used(self) -> int:
        """Its slots in use, by this router and by the other replicas."""
        return self.in_flight + self.elsewhere.in_flight

    @property
    def has_room(self) -> bool:
        return self.accepting and self.slots_used < self.max_concurrency

    @property
    def load(self) -> float:
        return self.slots_used / self.max_concurrency

    def unread(self, now: float, stale_after: float) -> int:
        """This router's requests on it that its last fresh reading does not count."""
        reading = self.engine.reading
        if not reading.fresh(now, stale_after):
            return self.in_flight
        return max(0, self.in_flight - reading.own_in_flight)

    @property
    def auth_headers(self) -> list[tuple[str, str]]:
        """The engine's own key, for the router's requests to it (models, metrics)."""
        return [("authorization", f"Bearer {self.api_key}")] if self.api_key else []

    def concurrency(self, now: float, stale_after: float) -> int:
        """Requests on the engine: its reading plus what this router sent since (router.backends.engines)."""
        return self.engine.concurrency(now, stale_after, in_flight=self.in_flight, elsewhere=self.elsewhere)

    def kv_projected(self, now: float, stale_after: float, tokens: int | None = None) -> float | None:
        """The engine's KV usage once one more request of `tokens` is sent (router.engines)."""
        return self.engine.kv_projected(
            now,
            stale_after,
            in_flight=self.in_flight,
            max_concurrency=self.max_concurrency,
            tokens=tokens,
            holding=self.holding.values(),
            elsewhere=self.elsewhere,
        )

    def overflow(self, now: float, stale_after: float, kv_threshold: float) -> int:
        """Its requests projected to wait inside the engine for KV room (router.backends.engines)."""
        return self.engine.overflow(
            now,
            stale_after,
            kv_threshold,
            in_flight=self.in_flight,
            max_concurrency=self.max_concurrency,
            holding=self.holding.values(),
            elsewhere=self.elsewhere,
        )

    def outlook(
        self, now: float, stale_after: float, kv_threshold: float, tokens: int | None = None
    ) -> tuple[bool, float | None, bool, int]:
        """Whether its engine's reading is fresh, `kv_projected`, whether the engine has room of
        its own for one more request of `tokens`, and `concurrency`, in one (router.backends.engines)."""
        return self.engine.outlook(
            now,
            stale_after,
            kv_threshold,
            in_flight=self.in_flight,
            max_concurrency=self.max_concurrency,
            tokens=tokens,
            holding=self.holding.values(),
            elsewhere=self.elsewhere,
        )
