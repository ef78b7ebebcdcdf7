"""The one definition of a percentile, for the live status and the benchmark reports alike."""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], share: float) -> float | None:
    """The `share` (0..1) quantile of `values`, interpolated between the two nearest ranks (as
    numpy does by default, so `percentile(v, 0.5)` is the median); None when there are none."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = share * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
