"""Learned speed curves."""

from __future__ import annotations

import pytest

from router.learn import SpeedModel, crossover


def test_prediction_interpolates_and_extrapolates_cautiously() -> None:
    model = SpeedModel()
    model.observe("f", "prose", concurrency=1, speed=60)
    model.observe("f", "prose", concurrency=5, speed=20)
    assert model.predict("f", "prose", 1) == 60
    assert model.predict("f", "prose", 3) == pytest.approx(40)
    assert model.predict("f", "prose", 10) == pytest.approx(10)  # total held level: 20 x 5 / 10
    assert model.predict("f", "code", 3) is None
    assert model.predict("f", "code", 3, fallback=True) == pytest.approx(40)


def test_running_mean_follows_new_observations() -> None:
    model = SpeedModel()
    for _ in range(30):
        model.observe("f", "prose", concurrency=2, speed=50)
    for _ in range(30):
        model.observe("f", "prose", concurrency=2, speed=30)
    assert model.predict("f", "prose", 2) == pytest.approx(30, rel=0.01)


def test_live_acceptance_scales_speculative_predictions() -> None:
    model = SpeedModel()
    model.observe("f", "code", concurrency=2, speed=80, gain=3.0)
    assert model.predict("f", "code", 2, gain=1.5) == pytest.approx(40)  # guesses half as good now
    assert model.predict("f", "code", 2) == pytest.approx(80)


def test_crossover_is_where_speculation_stops_paying() -> None:
    model = SpeedModel()
    for level, fast, slow in [(1, 58, 48), (2, 42, 41), (3, 33, 35), (6, 23, 26)]:
        model.observe("fast-1", "prose", concurrency=level, speed=fast)
        model.observe("team-1", "prose", concurrency=level, speed=slow)
    assert crossover(model, "fast-1", ["team-1"], "prose") == 3
    assert crossover(model, "fast-1", ["team-1"], "code") is None  # nothing known of code yet


def test_forget_drops_only_that_backends_curves() -> None:
    model = SpeedModel()
    for backend in ("a", "b"):
        model.observe(backend, "prose", concurrency=1, speed=50.0)
        model.observe(backend, "code", concurrency=1, speed=80.0)
    model.forget("a")
    assert model.curve("a", "prose") is None and model.curve("a", "code") is None
    assert model.curve("b", "prose") is not None
