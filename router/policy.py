"""Pure routing policy: a classified request and a snapshot of the pools -> a pool, with the reason.

Batch work goes to the standard pool. Interactive work goes to the speculative pool only while
that is the faster place for it; otherwise it spills to the standard pool:

- never where it would queue: the speculative engine has requests waiting, its KV cache is past
  the threshold, or the router's own slots for it are full (`spill:spec-queueing`,
  `spill:spec-kv-full`, `spill:spec-full`), nor where it cannot go (`spill:spec-down`,
  `spill:spec-draining`);
- `crossover` mode: not past the configured crossover concurrency for the content kind, unless
  the standard pool carries even more (`spill:past-crossover`);
- `adaptive` mode: to the pool with the higher predicted per-user speed, from speeds learned
  online (`spill:faster-on-standard`); until there is something learned, as in `crossover`.

`static` mode does none of this: interactive to the speculative pool, batch to the standard one
(interactive work still leaves a speculative pool that is down or drained).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from router.classify import Classification
from router.config import JobClass, Routing
from router.content import ContentKind


@dataclass(frozen=True, slots=True)
class PoolState:
    """What the policy knows of one pool at the moment of a decision."""

    speculative: bool
    healthy: bool = True  # has a backend that takes new work
    draining: bool = False  # ...and has none because an operator is draining them
    # Requests on its least-loaded healthy backend: the router's own or the engine's, the larger.
    concurrency: int = 0
    has_room: bool = True  # a backend below max_concurrency and nobody in the router's queue
    engine_queued: float = 0.0  # waiting inside its engines on two scrapes running (fresh only)
    # KV usage of its emptiest engine once this request is sent (projected from fresh scrapes).
    kv_usage: float | None = None
    # Predicted per-user tok/s for one more request, by content (adaptive mode; None: not learned).
    speed: Mapping[ContentKind, float | None] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Decision:
    pool: str
    job: JobClass
    reason: str
    content: ContentKind = "prose"


class Policy:
    def __init__(self, routing: Routing, *, interactive_pool: str, batch_pool: str) -> None:
        self._config = routing
        self._speculative = interactive_pool
        self._standard = batch_pool

    def decide(self, classification: Classification, content: ContentKind, pools: Mapping[str, PoolState]) -> Decision:
        job = classification.job

        def to(pool: str, reason: str = classification.reason) -> Decision:
            return Decision(pool, job, reason, content)

        if classification.pinned_pool is not None:
            return to(classification.pinned_pool, "pinned")
        if self._speculative == self._standard:
            return to(self._standard)

        spec, std = pools[self._speculative], pools[self._standard]
        if job == "batch":
            standard_unavailable = not std.healthy or not std.has_room
            spec_idle = self._blocked(spec) is None and spec.concurrency < self._config.crossover[content]
            if standard_unavailable and spec_idle and self._config.batch_may_use_speculative:
                return to(self._speculative, "borrow:standard-unavailable")
            return to(self._standard)

        blocked = self._unavailable(spec) if self._config.mode == "static" else self._blocked(spec)
        if blocked is not None:
            # Spill only to somewhere better: a standard pool that is up and has room.
            return to(self._standard, blocked) if std.healthy and std.has_room else to(self._speculative)
        if self._config.mode == "static" or not (std.healthy and std.has_room):
            return to(self._speculative)
        spec_speed, std_speed = spec.speed.get(content), std.speed.get(content)
        if self._config.mode == "adaptive" and spec_speed is not None and std_speed is not None:
            if std_speed > spec_speed:
                return to(self._standard, "spill:faster-on-standard")
            return to(self._speculative)
        # Past the crossover the standard pool is faster at the same load, and the more so the
        # fewer it serves; with more on it than on the speculative pool, it is not.
        if spec.concurrency + 1 > self._config.crossover[content] and std.concurrency <= spec.concurrency:
            return to(self._standard, "spill:past-crossover")
        return to(self._speculative)

    @staticmethod
    def _unavailable(spec: PoolState) -> str | None:
        """Why the speculative pool takes no new work at all, or None."""
        if spec.draining:
            return "spill:spec-draining"
        if not spec.healthy:
            return "spill:spec-down"
        return None

    def _blocked(self, spec: PoolState) -> str | None:
        """Why a request sent to the speculative pool now would wait, or None."""
        unavailable = self._unavailable(spec)
        if unavailable is not None:
            return unavailable
        if spec.engine_queued > 0:
            return "spill:spec-queueing"
        if spec.kv_usage is not None and spec.kv_usage >= self._config.kv_threshold:
            return "spill:spec-kv-full"
        if not spec.has_room:
            return "spill:spec-full"
        return None
