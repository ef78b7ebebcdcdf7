"""Per-user speed against concurrency, learned online from what the router measures.

Each finished stream gives one observation: the backend, the content kind, how many requests
the backend was serving when it started, and the tokens per second its user saw after the
first token. Observations go into a running mean per concurrency; a prediction between two
observed concurrencies is interpolated, and beyond the last one the backend is assumed to give
no more in total than it did there (speed × concurrency held level), which is cautious.

With speculation the speed also depends on how well the drafter is guessing. Each observation
on a speculative backend carries the tokens a sequence gained per step at the time (from the
engine's counters); a prediction is scaled by the live figure over the learned one.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field

from router.content import ContentKind

_WEIGHT = 0.2  # weight of a new observation in a bin's running mean
_MAX_CONCURRENCY = 512


@dataclass(slots=True)
class _Bin:
    speed: float
    gain: float | None  # tokens per step per sequence when observed (speculation), if known
    samples: int = 1


@dataclass(slots=True)
class Curve:
    """Observed per-user speed by concurrency, for one backend and content kind."""

    bins: dict[int, _Bin] = field(default_factory=dict)

    def observe(self, concurrency: int, speed: float, gain: float | None) -> None:
        concurrency = max(1, min(concurrency, _MAX_CONCURRENCY))
        found = self.bins.get(concurrency)
        if found is None:
            self.bins[concurrency] = _Bin(speed, gain)
            return
        found.speed += _WEIGHT * (speed - found.speed)
        if gain is not None:
            found.gain = gain if found.gain is None else found.gain + _WEIGHT * (gain - found.gain)
        found.samples += 1

    def predict(self, concurrency: int, gain: float | None = None) -> float | None:
        """Per-user tokens/s at `concurrency`, or None with nothing observed yet."""
        if not self.bins:
            return None
        levels = sorted(self.bins)
        at = bisect.bisect_left(levels, concurrency)
        if at < len(levels) and levels[at] == concurrency:
            found = self.bins[concurrency]
            speed = found.speed
        elif at == 0:
            found = self.bins[levels[0]]
            speed = found.speed  # fewer users than ever seen: at least as fast
        elif at == len(levels):
            found = self.bins[levels[-1]]
            speed = found.speed * levels[-1] / concurrency
        else:
            low, high = levels[at - 1], levels[at]
            share = (concurrency - low) / (high - low)
            found = self.bins[low]
            speed = self.bins[low].speed + share * (self.bins[high].speed - self.bins[low].speed)
        if gain is not None and found.gain:
            speed *= gain / found.gain
        return speed

    def points(self) -> Iterator[tuple[int, float, int]]:
        for level in sorted(self.bins):
            yield level, self.bins[level].speed, self.bins[level].samples


class SpeedModel:
    """Curves for every backend and content kind."""

    def __init__(self) -> None:
        self._curves: dict[tuple[str, ContentKind], Curve] = {}

    def observe(
        self, backend: str, kind: ContentKind, *, concurrency: int, speed: float, gain: float | None = None
    ) -> None:
        self._curves.setdefault((backend, kind), Curve()).observe(concurrency, speed, gain)

    def forget(self, backend: str) -> None:
        """Drop what was learned of a backend (another engine now answers under its name)."""
        for key in [key for key in self._curves if key[0] == backend]:
            del self._curves[key]

    def curve(self, backend: str, kind: ContentKind) -> Curve | None:
        return self._curves.get((backend, kind))

    def predict(
        self, backend: str, kind: ContentKind, concurrency: int, *, gain: float | None = None, fallback: bool = False
    ) -> float | None:
        """Predicted per-user speed; with `fallback`, the other content kind's curve stands in.

        Without speculation the content barely matters, so a standard backend that has only
        served prose still predicts well for code.
        """
        curve = self._curves.get((backend, kind))
        if curve is None and fallback:
            curve = self._curves.get((backend, "code" if kind == "prose" else "prose"))
        return curve.predict(concurrency, gain) if curve is not None else None


def crossover(
    speeds: SpeedModel, speculative: str, standard: list[str], kind: ContentKind, *, limit: int = 64
) -> int | None:
    """The first concurrency at which `speculative` is predicted slower per user than the best
    standard backend at the same concurrency; None until both have been observed."""
    for level in range(1, limit + 1):
        fast = speeds.predict(speculative, kind, level)
        slow = [s for name in standard if (s := speeds.predict(name, kind, level, fallback=True)) is not None]
        if fast is None or not slow:
            return None
        if fast < max(slow):
            return level
    return limit
