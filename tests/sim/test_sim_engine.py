"""The engine model on its own, in simulated time."""

from __future__ import annotations

import pytest

from router.content import ContentKind
from router.sim.calibrate import calibrate, table
from router.sim.engine import Engine
from router.sim.profile import Profile, load_profile


@pytest.fixture(scope="module")
def fast() -> Profile:
    return load_profile("fast")


@pytest.fixture(scope="module")
def team() -> Profile:
    return load_profile("team")


def test_calibration_reproduces_the_published_figures(fast: Profile, team: Profile) -> None:
    checks = calibrate(fast, team)
    print("\n" + table(checks))
    assert [c.figure.label for c in checks if not c.ok] == []


def test_admission_is_fifo_and_bounded_by_kv(fast: Profile) -> None:
    engine = Engine(fast)
    requests = [engine.add(f"r{i}", prompt_tokens=50, max_tokens=512, kind="prose", ignore_eos=True) for i in range(30)]
    engine.step()
    assert len(engine.running) == 23
    assert list(engine.waiting) == requests[23:]
    assert engine.kv_usage <= 1.0
    # Freeing one reservation admits exactly the next in line.
    engine.abort(requests[0])
    engine.step()
    assert requests[23] in engine.running and requests[24] in engine.waiting


def test_a_request_larger_than_the_kv_cache_runs_alone_and_is_never_stuck(team: Profile) -> None:
    """A reservation beyond the whole cache (a fitted profile's overhead can be one) waits for the
    others to finish, then runs alone: a FIFO never waits on a request that can never fit."""
    engine = Engine(team.model_copy(update={"kv_overhead_tokens": team.kv_cache_tokens}))
    first, second = (
        engine.add(f"r{i}", prompt_tokens=10, max_tokens=4, kind="prose", ignore_eos=True) for i in range(2)
    )
    engine.step()
    assert engine.running == [first] and list(engine.waiting) == [second]
    for _ in range(100):
        if not engine.busy:
            break
        engine.step()
    assert first.finished_at is not None and second.finished_at is not None
    assert second.scheduled_at is not None and first.finished_at <= second.scheduled_at


def test_max_num_seqs_bounds_running(team: Profile) -> None:
    engine = Engine(team.model_copy(update={"max_num_seqs": 5}))
    for i in range(8):
        engine.add(f"r{i}", prompt_tokens=10, max_tokens=8, kind="prose")
    engine.step()
    assert len(engine.running) == 5 and len(engine.waiting) == 3


def test_abort_frees_kv_at_once(fast: Profile) -> None:
    engine = Engine(fast)
    request = engine.add("r", prompt_tokens=50, max_tokens=512, kind="prose")
    engine.step()
    assert engine.reserved > 0
    engine.abort(request)
    assert engine.reserved == 0 and not engine.busy
    assert engine.counters.aborted == 1


def test_ignore_eos_and_min_tokens(team: Profile) -> None:
    engine = Engine(team)
    fixed = engine.add("a", prompt_tokens=10, max_tokens=700, kind="prose", ignore_eos=True)
    free = engine.add("b", prompt_tokens=10, max_tokens=700, kind="prose")
    floor = engine.add("c", prompt_tokens=10, max_tokens=700, kind="prose", min_tokens=699)
    while engine.busy:
        engine.step()
    assert fixed.generated == 700
    assert 1 <= free.generated <= 700
    assert floor.generated >= 699
    assert engine.counters.generation_tokens == fixed.generated + free.generated + floor.generated


def test_speculation_is_counted_and_code_is_guessed_better(fast: Profile) -> None:
    rates = {}
    kinds: tuple[ContentKind, ...] = ("prose", "code")
    for kind in kinds:
        engine = Engine(fast)
        engine.add("r", prompt_tokens=50, max_tokens=512, kind=kind, ignore_eos=True)
        while engine.busy:
            engine.step()
        counters = engine.counters
        assert counters.spec_draft_tokens == counters.spec_drafts * fast.speculation.num_tokens  # type: ignore[union-attr]
        rates[kind] = counters.spec_accepted_tokens / counters.spec_draft_tokens
    assert rates["code"] > rates["prose"]


def test_steps_grow_with_work_but_less_than_linearly(team: Profile) -> None:
    def step_time(users: int) -> float:
        engine = Engine(team)
        for i in range(users):
            engine.add(f"r{i}", prompt_tokens=10, max_tokens=64, kind="prose", ignore_eos=True)
        engine.step()  # prefill
        start = engine.now
        engine.step()
        return engine.now - start

    one, four, sixty_four = step_time(1), step_time(4), step_time(64)
    assert one < four < sixty_four
    assert sixty_four / one < 64


def test_same_seed_same_run(fast: Profile) -> None:
    def run(seed: int) -> list[int]:
        engine = Engine(fast, seed=seed)
        requests = [engine.add(f"r{i}", prompt_tokens=20, max_tokens=300, kind="prose") for i in range(3)]
        while engine.busy:
            engine.step()
        return [r.generated for r in requests] + [engine.counters.spec_accepted_tokens]

    assert run(1) == run(1)
    assert run(1) != run(2)
