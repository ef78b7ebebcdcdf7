"""The one clock of the router's live state: monotonic seconds, injected where time matters.

Ejection, scrape staleness, client memory, learned-speed decay and request timings all read
`clock.now()`, so a test drives time with a `ManualClock` instead of sleeping. Timeouts that
bound a wait (asyncio.timeout) stay on the event loop: they are waits, not readings.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale (only differences mean anything)."""
        ...


class MonotonicClock:
    """The real clock: `time.monotonic`."""

    def now(self) -> float:
        return time.monotonic()


class ManualClock:
    """A clock that moves only when told to (tests)."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += seconds
