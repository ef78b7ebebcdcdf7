"""The routing policy as a pure function: tables of pool states -> decisions."""

from __future__ import annotations

from typing import Any

import pytest

from router.config import Routing
from router.routing.classify import Classification
from router.routing.learn import Estimate
from router.routing.policy import Decision, Policy, PoolState

INTERACTIVE = Classification("interactive", "default")
BATCH = Classification("batch", "rule:etl")


def spec(**state: Any) -> PoolState:
    return PoolState(speculative=True, **state)


def std(**state: Any) -> PoolState:
    return PoolState(speculative=False, **state)


def _decide(
    classification: Classification, fast: PoolState, team: PoolState, content: str = "prose", **routing: Any
) -> Decision:
    policy = Policy(Routing(**routing), interactive_pool="fast", batch_pool="team")
    return policy.decide(classification, content, {"fast": fast, "team": team})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fast", "team", "content", "pool", "reason"),
    [
        # Light load: the speculative pool is the faster place.
        (spec(), std(), "prose", "fast", "default"),
        (spec(concurrency=2), std(concurrency=0), "prose", "fast", "default"),
        # Past the prose crossover (4) with the standard pool no busier: spill.
        (spec(concurrency=4), std(concurrency=0), "prose", "team", "spill:past-crossover"),
        # Code is guessed well: the crossover comes later.
        (spec(concurrency=4), std(concurrency=0), "code", "fast", "default"),
        (spec(concurrency=16), std(concurrency=0), "code", "team", "spill:past-crossover"),
        # Past the crossover, but the standard pool carries a batch job: stay.
        (spec(concurrency=8), std(concurrency=96), "prose", "fast", "default"),
        # Never where it would queue, whatever the concurrency.
        (spec(engine_queued=1), std(concurrency=96), "prose", "team", "spill:spec-queueing"),
        (spec(kv_usage=0.92), std(concurrency=96), "prose", "team", "spill:spec-kv-full"),
        (spec(kv_usage=0.5), std(), "prose", "fast", "default"),
        (spec(has_room=False), std(), "prose", "team", "spill:spec-full"),
        (spec(healthy=False), std(), "prose", "team", "spill:spec-down"),
        # ...unless the standard pool is no better off: then wait where it was going.
        (spec(engine_queued=3), std(has_room=False), "prose", "fast", "default"),
        (spec(healthy=False), std(healthy=False), "prose", "fast", "default"),
    ],
)
def test_interactive_in_crossover_mode(fast: PoolState, team: PoolState, content: str, pool: str, reason: str) -> None:
    decision = _decide(INTERACTIVE, fast, team, content, mode="crossover")
    assert (decision.pool, decision.reason, decision.content) == (pool, reason, content)


def speed(value: float, margin: float = 0.0) -> Estimate:
    return Estimate(value, value - margin, value + margin)


@pytest.mark.parametrize(
    ("fast_speed", "team_speed", "pool", "reason"),
    [
        (speed(40.0), speed(30.0), "fast", "default"),
        (speed(20.0), speed(30.0), "team", "spill:faster-on-standard"),
        # Not learned yet for one side: fall back to the crossover rule (concurrency 5 > 4).
        (None, speed(30.0), "team", "spill:past-crossover"),
        # Learned, but the difference is within the noise: the crossover rule decides.
        (speed(28.0, 3.0), speed(30.0, 3.0), "team", "spill:past-crossover"),
        # ...and a learned difference beyond the noise overrides it.
        (speed(40.0, 3.0), speed(30.0, 3.0), "fast", "default"),
    ],
)
def test_interactive_in_adaptive_mode_follows_predicted_speed(
    fast_speed: Estimate | None, team_speed: Estimate | None, pool: str, reason: str
) -> None:
    fast = spec(concurrency=5, speed={"prose": fast_speed})
    team = std(concurrency=5, speed={"prose": team_speed})
    decision = _decide(INTERACTIVE, fast, team, mode="adaptive")
    assert (decision.pool, decision.reason) == (pool, reason)


def test_adaptive_mode_still_never_sends_where_it_would_queue() -> None:
    fast = spec(engine_queued=2, speed={"prose": speed(90.0)})
    team = std(concurrency=100, speed={"prose": speed(4.0)})
    assert _decide(INTERACTIVE, fast, team, mode="adaptive").reason == "spill:spec-queueing"


# Interactive work is placed on predicted first token (target 3 s) and speed together.
@pytest.mark.parametrize("mode", ["crossover", "adaptive"])
@pytest.mark.parametrize(
    ("fast", "team", "pool", "reason"),
    [
        # On real engines: `team` KV 0.97 with requests waiting, `fast` 4 of 8 slots busy, the
        # standard pool learned faster per user: its queue costs more than speed gains. Stay.
        (
            spec(concurrency=4, kv_usage=0.5, ttft=0.1, speed={"prose": speed(14.0, 1)}),
            std(concurrency=9, kv_usage=0.97, engine_queued=3, ttft=1.8, speed={"prose": speed(40.0, 1)}),
            "fast",
            "default",
        ),
        # The standard pool is past the KV threshold (no requests waiting yet): it queues. Stay.
        (spec(concurrency=6, ttft=0.1), std(kv_usage=0.95, ttft=0.2, speed={"prose": speed(40.0)}), "fast", "default"),
        # The router's own queue for the standard pool is not empty: it queues. Stay.
        (spec(concurrency=6, ttft=0.1), std(has_room=False), "fast", "default"),
        # The standard pool keeps its first tokens past the target: stay, however fast it streams.
        (spec(concurrency=6, ttft=0.1), std(ttft=4.5, speed={"prose": speed(40.0)}), "fast", "default"),
        # Both would make it wait: the one whose first token comes sooner.
        (spec(kv_usage=0.95, ttft=20.0), std(engine_queued=2, kv_usage=0.95, ttft=2.0), "team", "spill:spec-kv-full"),
        (spec(kv_usage=0.95, ttft=1.0), std(engine_queued=2, kv_usage=0.95, ttft=9.0), "fast", "default"),
        # Nothing to go on for the standard pool's wait while it queues: not sooner, stay.
        (spec(engine_queued=1, ttft=5.0), std(engine_queued=4), "fast", "default"),
        # The speculative pool waits and the standard one does not: spill, as before.
        (spec(engine_queued=1, ttft=5.0), std(concurrency=96, ttft=2.0), "team", "spill:spec-queueing"),
    ],
)
def test_interactive_goes_where_the_first_token_comes_within_target(
    mode: str, fast: PoolState, team: PoolState, pool: str, reason: str
) -> None:
    decision = _decide(INTERACTIVE, fast, team, mode=mode)
    assert (decision.pool, decision.reason) == (pool, reason)


def test_the_first_token_target_is_a_setting() -> None:
    fast, team = spec(concurrency=6, ttft=0.1), std(ttft=4.5)
    assert _decide(INTERACTIVE, fast, team, mode="crossover").pool == "fast"
    assert _decide(INTERACTIVE, fast, team, mode="crossover", ttft_target=5.0).reason == "spill:past-crossover"


@pytest.mark.parametrize(
    ("team", "allowed", "pool", "reason"),
    [
        (std(), False, "team", "rule:etl"),
        (std(concurrency=200), True, "team", "rule:etl"),
        (std(healthy=False), False, "team", "rule:etl"),  # off by default: wait for the standard pool
        (std(healthy=False), True, "fast", "borrow:standard-unavailable"),
        (std(has_room=False), True, "fast", "borrow:standard-unavailable"),
    ],
)
def test_batch_uses_speculative_idle_room_only_when_allowed(
    team: PoolState, allowed: bool, pool: str, reason: str
) -> None:
    decision = _decide(BATCH, spec(), team, batch_may_use_speculative=allowed)
    assert (decision.pool, decision.job, decision.reason) == (pool, "batch", reason)


@pytest.mark.parametrize("fast", [spec(concurrency=4), spec(engine_queued=1), spec(kv_usage=0.95)])
def test_batch_never_borrows_a_speculative_pool_that_is_busy(fast: PoolState) -> None:
    decision = _decide(BATCH, fast, std(healthy=False), batch_may_use_speculative=True)
    assert decision.pool == "team"


def test_pinned_and_static() -> None:
    pinned = Classification("interactive", "header", pinned_pool="team")
    assert _decide(pinned, spec(), std()).reason == "pinned"
    assert _decide(pinned, spec(), std()).pool == "team"
    busy = spec(concurrency=30, engine_queued=9, kv_usage=0.99)
    assert _decide(INTERACTIVE, busy, std(), mode="static") == Decision("fast", "interactive", "default")
    assert _decide(BATCH, spec(), std(), mode="static").pool == "team"


@pytest.mark.parametrize("mode", ["static", "crossover", "adaptive"])
@pytest.mark.parametrize(
    ("fast", "reason"),
    [
        (spec(healthy=False), "spill:spec-down"),
        (spec(healthy=False, draining=True), "spill:spec-draining"),
    ],
)
def test_interactive_work_leaves_a_speculative_pool_that_takes_none_in_every_mode(
    mode: str, fast: PoolState, reason: str
) -> None:
    assert _decide(INTERACTIVE, fast, std(), mode=mode) == Decision("team", "interactive", reason)
    # ...but not for a standard pool that cannot take it either: the pool's own 503 is the answer.
    assert _decide(INTERACTIVE, fast, std(healthy=False), mode=mode).pool == "fast"


def _with_target(classification: Classification, fast: PoolState, team: PoolState, target: float | None) -> Decision:
    policy = Policy(Routing(mode="crossover"), interactive_pool="fast", batch_pool="team")
    return policy.decide(classification, "prose", {"fast": fast, "team": team}, ttft_target=target)


@pytest.mark.parametrize(
    ("fast", "team", "target", "pool", "reason"),
    [
        # No target of its own: as without the header.
        (spec(ttft=2.0), std(ttft=0.3), None, "fast", "default"),
        # Within its target where the policy sends it: nothing changes.
        (spec(ttft=2.0), std(ttft=0.3), 2.5, "fast", "default"),
        # A voice assistant's 0.5 s: the speculative pool's 2 s is too late, the standard's 0.3 s is not.
        (spec(ttft=2.0), std(ttft=0.3), 0.5, "team", "slo:ttft"),
        # Nowhere within 0.1 s: where it comes soonest.
        (spec(ttft=2.0), std(ttft=0.3), 0.1, "team", "slo:unmet"),
        (spec(ttft=0.2), std(ttft=0.3), 0.1, "fast", "slo:unmet"),
        # A looser target than the setting's lets the policy keep it on the speculative pool, where
        # the setting's 3 s would have spilled past a standard pool predicted within 3 s... (same here)
        (spec(ttft=1.0), std(ttft=5.0), 10.0, "fast", "default"),
        # A pool that takes no work is no candidate, however soon.
        (spec(ttft=2.0), std(ttft=0.1, healthy=False), 0.5, "fast", "slo:unmet"),
        # Nothing predicted: taken as within.
        (spec(), std(), 0.1, "fast", "default"),
    ],
)
def test_a_requests_own_first_token_target(
    fast: PoolState, team: PoolState, target: float | None, pool: str, reason: str
) -> None:
    decision = _with_target(INTERACTIVE, fast, team, target)
    assert (decision.pool, decision.reason) == (pool, reason)


def test_a_first_token_target_moves_neither_batch_work_nor_a_pinned_request() -> None:
    assert _with_target(BATCH, spec(ttft=0.1), std(ttft=9.0), 0.5).pool == "team"
    pinned = Classification("interactive", "header", pinned_pool="fast")
    assert _with_target(pinned, spec(ttft=9.0), std(ttft=0.1), 0.5).pool == "fast"


@pytest.mark.parametrize("mode", ["static", "crossover", "adaptive"])
def test_a_decision_carries_the_first_token_predicted_for_its_pool(mode: str) -> None:
    """What the policy went by is kept with the decision, to be set against what happened."""
    fast, team = spec(ttft=0.4), std(ttft=2.5)
    assert _decide(INTERACTIVE, fast, team, mode=mode).predicted_ttft == 0.4
    assert _decide(BATCH, fast, team, mode=mode).predicted_ttft == 2.5
    pinned = Classification("interactive", "header", pinned_pool="team")
    assert _decide(pinned, fast, team, mode=mode).predicted_ttft == 2.5
    assert _decide(INTERACTIVE, spec(engine_queued=3, ttft=9.0), std(ttft=1.0), mode="crossover").predicted_ttft == 1.0
    assert _decide(INTERACTIVE, spec(), std()).predicted_ttft is None  # nothing to go on
