"""Learned speeds shrunk toward a prior curve (a pool's `prior_speed`): the prior alone until a
point is trusted, then pulled toward it by `learn.prior_weight` answers, converging to what is
measured; without a prior, exactly as before."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.clock import ManualClock
from router.config import Learn, Routing
from router.content import CONTENT_KINDS, ContentKind
from router.demo import cluster_settings, prior_speeds
from router.routing.classify import Classification
from router.routing.learn import Estimate, SpeedModel, crossover
from router.routing.policy import Policy, PoolState
from router.sim.profile import load_profile


def _model(priors: dict[str, Any] | None = None, **learn: Any) -> tuple[SpeedModel, ManualClock]:
    clock = ManualClock()
    model = SpeedModel(clock=clock)
    model.configure(Learn(**learn), priors=priors)
    return model, clock


def _feed(model: SpeedModel, backend: str, concurrency: int, speed: float, *, times: int = 10) -> None:
    for _ in range(times):
        model.observe(backend, "prose", concurrency=concurrency, speed=speed, tokens=256)


def test_without_a_prior_predictions_are_exactly_as_before() -> None:
    rng = random.Random(3)
    plain, _ = _model()
    other, _ = _model({"elsewhere": {"prose": {1: 500.0}}}, prior_weight=50)  # another backend's prior
    for _ in range(300):
        level, speed, tokens = rng.randint(1, 8), rng.uniform(20, 80), rng.randint(1, 600)
        for model in (plain, other):
            model.observe("f", "prose", concurrency=level, speed=speed, tokens=tokens)
    for level in range(1, 20):
        for kind in ("prose", "code"):
            assert plain.predict("f", kind, level, fallback=True) == other.predict("f", kind, level, fallback=True)
    assert plain.predict("g", "prose", 1) is None


def test_the_prior_alone_before_anything_is_learned() -> None:
    model, _ = _model({"f": {"prose": {1: 60.0, 5: 20.0}}})
    # As good as a point just trusted: within max_interval (10 %).
    assert model.predict("f", "prose", 1) == pytest.approx((60, 54, 66))
    assert model.predict("f", "prose", 3) == pytest.approx((40, 36, 44))
    assert model.predict("f", "prose", 10) == pytest.approx((10, 9, 11))  # total held level, as learned
    assert model.predict("f", "code", 3) is None  # no code prior, nothing learned
    assert model.predict("f", "code", 3, fallback=True) == pytest.approx((40, 36, 44))


def test_an_untrusted_point_leaves_the_prior() -> None:
    model, _ = _model({"f": {"prose": {1: 100.0}}}, min_samples=8)
    _feed(model, "f", 1, 50, times=7)
    assert model.predict("f", "prose", 1) == pytest.approx((100, 90, 110))


def test_a_trusted_point_is_shrunk_toward_the_prior_by_its_weight() -> None:
    model, _ = _model({"f": {"prose": {1: 100.0}}}, min_samples=8, prior_weight=8)
    _feed(model, "f", 1, 50, times=8)
    # Eight answers against a prior worth eight: halfway. The interval reaches the learned mean.
    assert model.predict("f", "prose", 1) == pytest.approx((75, 50, 75))
    _feed(model, "f", 1, 50, times=792)
    assert model.predict("f", "prose", 1) == pytest.approx((50.4975, 50, 50.4975), rel=1e-4)


def test_a_prior_weight_of_zero_uses_trusted_points_as_learned() -> None:
    model, _ = _model({"f": {"prose": {1: 100.0}}}, prior_weight=0)
    _feed(model, "f", 1, 50)
    assert model.predict("f", "prose", 1) == Estimate(50, 50, 50)


def test_the_interval_narrows_as_answers_accumulate() -> None:
    model, _ = _model({"f": {"prose": {1: 100.0}}}, min_samples=4, max_interval=1.0)
    rng = random.Random(11)
    widths = []
    for more in (10, 90, 900):  # 10, 100, 1000 answers in all
        for _ in range(more):
            model.observe("f", "prose", concurrency=1, speed=100 * rng.uniform(0.7, 1.3), tokens=256)
        estimate = model.predict("f", "prose", 1)
        assert estimate is not None
        widths.append(estimate.high - estimate.low)
    assert widths[0] > widths[1] > widths[2]


def test_the_prior_gives_the_shape_between_and_beyond_trusted_points() -> None:
    model, _ = _model({"f": {"prose": {1: 100.0, 4: 50.0, 8: 25.0}}}, prior_weight=0)
    _feed(model, "f", 4, 40)  # 80 % of the prior there
    assert model.predict("f", "prose", 4) == pytest.approx((40, 40, 40))
    assert model.predict("f", "prose", 8) == pytest.approx((20, 20, 20))
    assert model.predict("f", "prose", 1) == pytest.approx((80, 80, 80))
    _feed(model, "f", 8, 25)  # 100 % there: between, the ratio is interpolated
    assert model.predict("f", "prose", 6) == pytest.approx((37.5 * 0.9, 37.5 * 0.9, 37.5 * 0.9))


def test_short_answers_do_not_stand_in_for_a_prior() -> None:
    model, _ = _model({"f": {"prose": {1: 100.0}}})
    for _ in range(20):
        model.observe("f", "prose", concurrency=1, speed=30, tokens=16)
    assert model.predict("f", "prose", 1) == pytest.approx((100, 90, 110))


def test_a_reload_replaces_the_priors() -> None:
    model, _ = _model({"f": {"prose": {1: 100.0}}})
    model.configure(Learn(), priors={"f": {"prose": {1: 70.0}}})
    assert model.predict("f", "prose", 1) == pytest.approx((70, 63, 77))
    model.configure(Learn(), priors={})
    assert model.predict("f", "prose", 1) is None


LOAD = 6


def _decide(model: SpeedModel, crossover: dict[ContentKind, int]) -> str:
    fast, team = model.predict("fast-1", "prose", LOAD), model.predict("team-1", "prose", LOAD, fallback=True)
    policy = Policy(Routing(mode="adaptive", crossover=crossover), interactive_pool="fast", batch_pool="team")
    pools = {
        "fast": PoolState(speculative=True, concurrency=LOAD - 1, speed={"prose": fast}),
        "team": PoolState(speculative=False, concurrency=LOAD - 1, speed={"prose": team}),
    }
    return policy.decide(Classification("interactive", "default"), "prose", pools).pool


@settings(max_examples=100, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    spec_faster=st.booleans(),
    off=st.tuples(st.floats(0.6, 1.4), st.floats(0.6, 1.4)),
    long_tokens=st.integers(64, 2048),
)
def test_noise_around_a_truth_off_the_prior_converges_to_it(
    seed: int, spec_faster: bool, off: tuple[float, float], long_tokens: int
) -> None:
    """±30 % noise around a truth that the prior misses by up to 40 % either way: given enough
    answers the estimate is the truth's, whatever the prior said."""
    rng = random.Random(seed)
    truth = {"fast-1": 115.0, "team-1": 100.0} if spec_faster else {"fast-1": 100.0, "team-1": 115.0}
    priors = {name: {"prose": {LOAD: speed * factor}} for (name, speed), factor in zip(truth.items(), off, strict=True)}
    model, clock = _model(priors)
    for _ in range(600):
        for backend, speed in truth.items():
            model.observe(
                backend,
                "prose",
                concurrency=LOAD,
                speed=speed * rng.uniform(0.7, 1.3),
                tokens=rng.randint(64, long_tokens),
            )
        clock.advance(rng.uniform(0, 1))
    for backend, speed in truth.items():
        estimate = model.predict(backend, "prose", LOAD)
        assert estimate is not None and estimate.speed == pytest.approx(speed, rel=0.05)
    assert _decide(model, {"prose": 2, "code": 16}) == ("fast" if spec_faster else "team")


@settings(max_examples=100, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    spec_faster=st.booleans(),
    off=st.floats(0.85, 1.15),
    long_tokens=st.integers(64, 2048),
)
def test_noise_never_flips_the_decision_with_a_prior(
    seed: int, spec_faster: bool, off: float, long_tokens: int
) -> None:
    """±30 % noise around a fixed truth, the pools 15 % apart; the prior misses both by up to
    15 % the same way and orders them as the truth does (the configured crossover too): after
    every answer, the decision is the truth's. (A prior off by more than the gap can, while one
    pool's point is trusted and the other's is not, compare a measurement with a wrong prior.)"""
    rng = random.Random(seed)
    truth = {"fast-1": 100.0, "team-1": 115.0} if not spec_faster else {"fast-1": 115.0, "team-1": 100.0}
    priors = {name: {"prose": {LOAD: speed * off}} for name, speed in truth.items()}
    model, clock = _model(priors)
    crossover: dict[ContentKind, int] = {"prose": 99 if spec_faster else 2, "code": 16}
    want = "fast" if spec_faster else "team"
    assert _decide(model, crossover) == want
    for _ in range(300):
        for backend, speed in truth.items():
            model.observe(
                backend,
                "prose",
                concurrency=LOAD,
                speed=speed * rng.uniform(0.7, 1.3),
                tokens=rng.randint(64, long_tokens),
            )
        clock.advance(rng.uniform(0, 5))
        assert _decide(model, crossover) == want


def test_the_simulated_cluster_starts_with_its_calibrated_speeds() -> None:
    """What the demo's priors say against the configured crossover (prose 4, code 16): at the
    same load the calibrated curves cross for prose at 3 and never for code (the speculative
    engine stays faster per running request; past 23 it queues instead, which the first-token
    prediction sees). Within ±10 % of each other they decide nothing at equal load: the
    configured crossover still does. They do decide between unequal loads, e.g. a third prose
    request on the speculative pool against an idle standard pool."""
    fast, team = prior_speeds(load_profile("fast")), prior_speeds(load_profile("team"))
    slower = {kind: [n for n in fast[kind] if fast[kind][n] < team[kind][n]] for kind in CONTENT_KINDS}
    assert min(slower["prose"]) == 3
    assert slower["code"] == []
    model, _ = _model({"fast-1": fast, "team-1": team})
    assert crossover(model, "fast-1", ["team-1"], "prose") == 64  # never beyond the noise
    spec, std = model.predict("fast-1", "prose", 3), model.predict("team-1", "prose", 1, fallback=True)
    assert spec is not None and std is not None and std.low > spec.high
    settings = cluster_settings({"fast": (True, ["http://127.0.0.1:1"])}, host="h", port=1, priors={"fast": fast})
    assert settings.pools["fast"].prior_speed == fast
    assert prior_speeds(load_profile("fast"), time_scale=5)["code"][1] == pytest.approx(5 * fast["code"][1], rel=0.01)
