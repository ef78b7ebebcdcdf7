"""`Figures`, the workers' shared state in the supervisor: the same answers as the replicas'
Redis scripts (tests/replicas/test_redis_store.py), with no I/O."""

from __future__ import annotations

from router.backends.engines import Elsewhere
from router.replicas.store import Ask
from router.workers.figures import Figures


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def figures(*, memory: float = 60.0, max_clients: int = 100) -> tuple[Figures, Clock]:
    clock = Clock()
    shared = Figures(memory=memory, max_clients=max_clients, clock=clock)
    for worker in (0, 1):
        shared.join(worker)
    return shared, clock


def ask(backend: str = "b", *, limit: int = 3, client: str = "c", here: int = 1, unread: int = 0) -> Ask:
    return Ask(backend, unread, limit, client, here)


def test_a_backend_slot_is_granted_only_within_the_limit_across_workers() -> None:
    shared, _ = figures()
    assert [c.granted for c in shared.claim(0, [ask(unread=1), ask(unread=2)]).claims] == [True, True]
    claims = shared.claim(1, [ask(unread=5)])
    assert claims.claims[0].granted and claims.backends == {"b": Elsewhere(2, 2)}
    refused = shared.claim(1, [ask(unread=5)])
    assert not refused.claims[0].granted and refused.backends == {"b": Elsewhere(2, 2)}
    shared.ended(0, {}, {"b": 1}, {"b": 0})
    assert shared.claim(1, [ask()]).claims[0].granted


def test_a_worker_that_leaves_frees_its_slots_and_clients_at_once() -> None:
    shared, _ = figures()
    assert all(c.granted for c in shared.claim(0, [ask(client="etl", here=n) for n in (1, 2, 3)]).claims)
    assert shared.client(1, "etl", here=1).in_flight == 3
    assert not shared.claim(1, [ask(client="etl")]).claims[0].granted
    shared.leave(0)
    assert shared.client(1, "etl", here=1).in_flight == 0
    assert shared.claim(1, [ask()]).claims[0].granted
    assert shared.workers == 1


def test_a_client_split_between_workers_is_counted_whole_and_its_peak_fades() -> None:
    shared, clock = figures(memory=10.0)
    shared.client(0, "etl", here=3)
    share = shared.client(1, "etl", here=1)
    assert share.in_flight == 3 and share.peak == 4
    shared.ended(0, {"etl": 0}, {}, {})
    shared.ended(1, {"etl": 0}, {}, {})
    clock.now = 10.0
    share = shared.client(1, "etl", here=0)
    assert share.in_flight == 0 and share.peak == 2.0  # halved in `memory` seconds


def test_sync_replaces_a_workers_figures_and_answers_the_others() -> None:
    shared, _ = figures()
    shared.claim(0, [ask(limit=9)])
    view = shared.sync(0, {"c": 2}, {"b": Elsewhere(4, 1)})
    assert view.replicas == 1 and dict(view.backends) == {}
    view = shared.sync(1, {}, {})
    assert dict(view.backends) == {"b": Elsewhere(4, 1)}
    assert shared.client(1, "c", here=0).in_flight == 2


def test_a_flood_of_distinct_clients_keeps_at_most_max_clients_peaks() -> None:
    shared, _ = figures(max_clients=50)
    for n in range(5000):
        shared.client(n % 2, f"flood-{n}", here=1)
        shared.ended(n % 2, {f"flood-{n}": 0}, {}, {})
    assert shared.remembered == 50
    # The most recent are the ones kept: a client seen last still has its peak.
    assert shared.client(0, "flood-4999", here=0).peak == 1


def test_faded_peaks_are_forgotten_at_a_sync() -> None:
    shared, clock = figures(memory=1.0)
    for n in range(10):
        shared.client(0, f"c{n}", here=1)
        shared.ended(0, {f"c{n}": 0}, {}, {})
    shared.sync(0, {}, {})
    clock.now = 5.0
    shared.sync(0, {}, {})
    assert shared.remembered == 0
