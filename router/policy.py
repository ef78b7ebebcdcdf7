"""Pure routing policy: a classified request -> the pool that serves it, with the reason."""

from __future__ import annotations

from dataclasses import dataclass

from router.classify import Classification
from router.config import JobClass, Settings


@dataclass(frozen=True, slots=True)
class Decision:
    pool: str
    job: JobClass
    reason: str


class StaticPolicy:
    """Interactive work to the speculative pool, batch work to the standard pool."""

    def __init__(self, settings: Settings) -> None:
        self._targets: dict[JobClass, str] = {
            "interactive": settings.pool_for("interactive"),
            "batch": settings.pool_for("batch"),
        }

    def decide(self, classification: Classification) -> Decision:
        if classification.pinned_pool is not None:
            return Decision(classification.pinned_pool, classification.job, "pinned")
        return Decision(self._targets[classification.job], classification.job, classification.reason)
