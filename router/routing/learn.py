"""Per-user speed against concurrency, learned online from finished streams and shrunk toward a
pool's prior speed; trusted only past a sample count and interval width. How and why:
docs/architecture.md, "Learned speeds"."""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from router.clock import Clock, MonotonicClock
from router.config import Learn
from router.content import CONTENT_KINDS, ContentKind

_MAX_CONCURRENCY = 512
_Z95 = 1.96
SHORT_ANSWER = 64  # tokens: shorter answers are learned apart from longer ones


class Estimate(NamedTuple):
    """A predicted per-user speed (tokens/s) with its 95 % interval."""

    speed: float
    low: float
    high: float

    def scaled(self, factor: float) -> Estimate:
        return Estimate(self.speed * factor, self.low * factor, self.high * factor)


@dataclass(frozen=True, slots=True)
class Trust:
    min_samples: int = 8
    max_interval: float = 0.1
    half_life: float = 600.0
    prior_weight: float = 8.0


@dataclass(slots=True)
class _Bin:
    """Weighted sums of the observations at one concurrency, all decayed to `at`."""

    at: float
    weight: float = 0.0
    total: float = 0.0
    squares: float = 0.0
    weight_squared: float = 0.0  # for the effective number of samples under unequal weights
    gain_weight: float = 0.0
    gain_total: float = 0.0
    samples: float = 0.0  # answers, fading like their weights

    def decay(self, now: float, half_life: float) -> None:
        factor = 0.5 ** (max(0.0, now - self.at) / half_life)
        self.weight *= factor
        self.total *= factor
        self.squares *= factor
        self.weight_squared *= factor * factor
        self.gain_weight *= factor
        self.gain_total *= factor
        self.samples *= factor
        self.at = max(self.at, now)

    def add(self, speed: float, weight: float, gain: float | None) -> None:
        self.weight += weight
        self.total += weight * speed
        self.squares += weight * speed * speed
        self.weight_squared += weight * weight
        if gain is not None:
            self.gain_weight += weight
            self.gain_total += weight * gain
        self.samples += 1

    @property
    def mean(self) -> float:
        return self.total / self.weight if self.weight > 0 else 0.0

    @property
    def gain(self) -> float | None:
        return self.gain_total / self.gain_weight if self.gain_weight > 0 else None

    @property
    def effective(self) -> float:
        """The number of equally weighted answers these unequal weights are worth (Kish)."""
        return self.weight * self.weight / self.weight_squared if self.weight_squared > 0 else 0.0

    def half_width(self) -> float:
        """Half the 95 % confidence interval of the mean."""
        if self.weight <= 0 or self.samples < 2:
            return math.inf
        effective = self.effective
        variance = max(0.0, self.squares / self.weight - self.mean**2) * effective / max(1.0, effective - 1)
        return _Z95 * math.sqrt(variance / effective)

    def trusted(self, trust: Trust) -> bool:
        return self.samples >= trust.min_samples and self.half_width() <= trust.max_interval * self.mean


@dataclass(slots=True)
class Curve:
    """Observed per-user speed by concurrency, for one backend, content kind and answer length."""

    trust: Trust = field(default_factory=Trust)
    bins: dict[int, _Bin] = field(default_factory=dict)

    def observe(self, concurrency: int, speed: float, *, tokens: int, gain: float | None, now: float) -> None:
        concurrency = max(1, min(concurrency, _MAX_CONCURRENCY))
        found = self.bins.setdefault(concurrency, _Bin(now))
        found.decay(now, self.trust.half_life)
        found.add(speed, float(max(1, tokens)), gain)

    def predict(
        self, concurrency: int, gain: float | None = None, *, now: float, prior: Prior | None = None
    ) -> Estimate | None:
        """Per-user tokens/s at `concurrency`, or None with no trusted point yet and no prior."""
        for each in self.bins.values():
            each.decay(now, self.trust.half_life)
        trusted = {level: b for level, b in self.bins.items() if b.trusted(self.trust)}
        if prior is not None:
            return self._predict_with(prior, trusted, concurrency, gain)
        if not trusted:
            return None
        levels = sorted(trusted)
        at = bisect.bisect_left(levels, concurrency)
        if at < len(levels) and levels[at] == concurrency:
            found = trusted[concurrency]
            estimate = _estimate(found)
        elif at == 0:
            found = trusted[levels[0]]
            estimate = _estimate(found)  # fewer users than ever seen: at least as fast
        elif at == len(levels):
            found = trusted[levels[-1]]
            estimate = _estimate(found).scaled(levels[-1] / concurrency)
        else:
            low, high = levels[at - 1], levels[at]
            share = (concurrency - low) / (high - low)
            found = trusted[low]
            below, above = _estimate(trusted[low]), _estimate(trusted[high])
            estimate = Estimate(*(b + share * (a - b) for b, a in zip(below, above, strict=True)))
        learned_gain = found.gain
        if gain is not None and learned_gain:
            estimate = estimate.scaled(gain / learned_gain)
        return estimate

    def _predict_with(self, prior: Prior, trusted: dict[int, _Bin], concurrency: int, gain: float | None) -> Estimate:
        expected = prior.at(concurrency)
        if not trusted:
            # Counted as good as a point just trusted: within `max_interval` of its speed. So
            # two priors decide only where they differ by more than a trusted point's noise.
            spread = self.trust.max_interval * expected
            return Estimate(expected, expected - spread, expected + spread)

        def relative(level: int) -> Estimate:
            """A trusted point, shrunk toward the prior, as a share of the prior there."""
            return _shrunk(trusted[level], prior.at(level), self.trust.prior_weight).scaled(1 / prior.at(level))

        levels = sorted(trusted)
        at = bisect.bisect_left(levels, concurrency)
        if at < len(levels) and levels[at] == concurrency:
            found, share = trusted[concurrency], relative(concurrency)
        elif at == 0 or at == len(levels):
            level = levels[0] if at == 0 else levels[-1]
            found, share = trusted[level], relative(level)  # the prior's shape beyond what was seen
        else:
            low, high = levels[at - 1], levels[at]
            part = (concurrency - low) / (high - low)
            found = trusted[low]
            below, above = relative(low), relative(high)
            share = Estimate(*(b + part * (a - b) for b, a in zip(below, above, strict=True)))
        estimate = share.scaled(expected)
        learned_gain = found.gain
        if gain is not None and learned_gain:
            estimate = estimate.scaled(gain / learned_gain)
        return estimate

    def points(self) -> Iterator[tuple[int, float, float, bool]]:
        """(concurrency, mean speed, answers (faded), trusted) for every concurrency observed."""
        for level in sorted(self.bins):
            found = self.bins[level]
            yield level, found.mean, found.samples, found.trusted(self.trust)


def _estimate(found: _Bin) -> Estimate:
    mean, half = found.mean, found.half_width()
    return Estimate(mean, mean - half, mean + half)


def _shrunk(found: _Bin, prior: float, weight: float) -> Estimate:
    """A trusted point's mean pulled toward `prior` as if it were `weight` more answers; the
    interval narrowed likewise, and stretched to cover the learned mean too."""
    answers, learned = found.effective, found.mean
    mean = (weight * prior + answers * learned) / (weight + answers)
    half = found.half_width() * math.sqrt(answers / (answers + weight))
    return Estimate(mean, min(mean, learned) - half, max(mean, learned) + half)


@dataclass(frozen=True, slots=True)
class Prior:
    """A speed curve known in advance: per-user tokens/s at some concurrencies (sorted)."""

    points: tuple[tuple[int, float], ...]

    def at(self, concurrency: int) -> float:
        """Interpolated between the given points; below the first, its speed (at least as fast);
        beyond the last, the total there held level, as for learned points."""
        levels = [level for level, _ in self.points]
        at = bisect.bisect_left(levels, concurrency)
        if at < len(levels) and levels[at] == concurrency:
            return self.points[at][1]
        if at == 0:
            return self.points[0][1]
        if at == len(levels):
            level, speed = self.points[-1]
            return speed * level / concurrency
        (low, below), (high, above) = self.points[at - 1], self.points[at]
        return below + (concurrency - low) / (high - low) * (above - below)


class SpeedModel:
    """Curves for every backend, content kind and answer length (short or long)."""

    def __init__(self, trust: Trust | None = None, *, clock: Clock | None = None) -> None:
        self.trust = trust or Trust()
        self._clock = clock or MonotonicClock()
        self._curves: dict[tuple[str, ContentKind, bool], Curve] = {}
        self._priors: dict[tuple[str, ContentKind], Prior] = {}

    def configure(
        self, config: Learn, priors: Mapping[str, Mapping[ContentKind, Mapping[int, float]]] | None = None
    ) -> None:
        """The (re)loaded `learn` section, and the prior speeds by backend (its pool's)."""
        trust = Trust(
            min_samples=config.min_samples,
            max_interval=config.max_interval,
            half_life=config.half_life,
            prior_weight=config.prior_weight,
        )
        self.trust = trust
        for curve in self._curves.values():
            curve.trust = trust
        self._priors = {
            (backend, kind): Prior(tuple(sorted(table.items())))
            for backend, tables in (priors or {}).items()
            for kind, table in tables.items()
            if table
        }

    def add_prior(self, backend: str, tables: Mapping[ContentKind, Mapping[int, float]]) -> None:
        """The prior speeds of a backend found since the last `configure` (its pool's)."""
        for kind, table in tables.items():
            if table:
                self._priors[(backend, kind)] = Prior(tuple(sorted(table.items())))

    def prior(self, backend: str, kind: ContentKind) -> Prior | None:
        return self._priors.get((backend, kind))

    def observe(
        self,
        backend: str,
        kind: ContentKind,
        *,
        concurrency: int,
        speed: float,
        tokens: int,
        gain: float | None = None,
    ) -> None:
        short = tokens < SHORT_ANSWER
        curve = self._curves.setdefault((backend, kind, short), Curve(self.trust))
        curve.observe(concurrency, speed, tokens=tokens, gain=gain, now=self._clock.now())

    def forget(self, backend: str) -> None:
        """Drop what was learned of a backend (another engine now answers under its name, or it
        is gone); its prior comes back with the next `configure` if it is still configured."""
        for key in [key for key in self._curves if key[0] == backend]:
            del self._curves[key]
        for kind in [kind for name, kind in self._priors if name == backend]:
            del self._priors[(backend, kind)]

    def curve(self, backend: str, kind: ContentKind, *, short: bool = False) -> Curve | None:
        return self._curves.get((backend, kind, short))

    def predict(
        self, backend: str, kind: ContentKind, concurrency: int, *, gain: float | None = None, fallback: bool = False
    ) -> Estimate | None:
        """Predicted per-user speed: from long answers' trusted points, shrunk toward the pool's
        prior for this content if it has one; before any is trusted, the prior alone where there
        is one (a sweep's long answers describe the next long answer better than short answers'
        speeds, mostly the noise of their first steps), else short answers' trusted points. With
        `fallback`, the other content kind's curves stand in: without speculation the content
        barely matters, so a standard backend that has only served prose still predicts well
        for code."""
        kinds: list[ContentKind] = [kind]
        if fallback:
            kinds.append("code" if kind == "prose" else "prose")
        now = self._clock.now()
        for each in kinds:
            for short in (False, True):
                # A prior describes long answers (a sweep's): short ones are learned on their own.
                prior = None if short else self._priors.get((backend, each))
                curve = self._curves.get((backend, each, short))
                if curve is None and prior is not None:
                    curve = Curve(self.trust)  # nothing learned yet: the prior alone
                estimate = curve.predict(concurrency, gain, now=now, prior=prior) if curve is not None else None
                if estimate is not None:
                    return estimate
        return None


class Predictions(Mapping[ContentKind, Estimate | None]):
    """A backend's predicted speeds by content kind, each worked out when first read.

    A snapshot of the pools is taken for every request, but the policy reads a speed only in
    `adaptive` mode, and then of one content kind: predicting every kind up front (each decays
    and weighs every point of up to four curves) was work thrown away on most requests."""

    __slots__ = ("_backend", "_concurrency", "_fallback", "_gain", "_known", "_model")

    def __init__(
        self, model: SpeedModel, backend: str, concurrency: int, *, gain: float | None, fallback: bool
    ) -> None:
        self._model = model
        self._backend = backend
        self._concurrency = concurrency
        self._gain = gain
        self._fallback = fallback
        self._known: dict[ContentKind, Estimate | None] = {}

    def __getitem__(self, kind: ContentKind) -> Estimate | None:
        if kind in self._known:
            return self._known[kind]
        if kind not in CONTENT_KINDS:
            raise KeyError(kind)
        estimate = self._model.predict(self._backend, kind, self._concurrency, gain=self._gain, fallback=self._fallback)
        self._known[kind] = estimate
        return estimate

    def __iter__(self) -> Iterator[ContentKind]:
        return iter(CONTENT_KINDS)

    def __len__(self) -> int:
        return len(CONTENT_KINDS)


def crossover(
    speeds: SpeedModel, speculative: str, standard: list[str], kind: ContentKind, *, limit: int = 64
) -> int | None:
    """The first concurrency at which `speculative` is predicted slower per user than the best
    standard backend at the same concurrency, beyond the noise of both; None until both have
    trusted points."""
    for level in range(1, limit + 1):
        fast = speeds.predict(speculative, kind, level)
        slow = [s for name in standard if (s := speeds.predict(name, kind, level, fallback=True)) is not None]
        if fast is None or not slow:
            return None
        if fast.high < max(s.low for s in slow):
            return level
    return limit
