"""The one percentile: the status page and the benchmark reports read the same numbers."""

from __future__ import annotations

import statistics

import pytest

from router.quantiles import percentile


@pytest.mark.parametrize(
    ("values", "share", "expected"),
    [
        ([], 0.5, None),
        ([3.0], 0.99, 3.0),
        ([1.0, 2.0, 3.0, 4.0], 0.0, 1.0),
        ([1.0, 2.0, 3.0, 4.0], 1.0, 4.0),
        ([4.0, 1.0, 3.0, 2.0], 0.5, 2.5),  # unsorted in, the median out
        ([1.0, 2.0, 3.0, 4.0, 5.0], 0.25, 2.0),
        ([0.0, 10.0], 0.95, 9.5),  # between the two nearest ranks
    ],
)
def test_percentile(values: list[float], share: float, expected: float | None) -> None:
    assert percentile(values, share) == pytest.approx(expected)


def test_the_half_is_the_median() -> None:
    values = [0.3, 0.1, 0.7, 0.2, 0.9, 0.4]
    assert percentile(values, 0.5) == pytest.approx(statistics.median(values))
