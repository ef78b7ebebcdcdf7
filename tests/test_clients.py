"""Each client's requests in flight, and the fading memory of its recent peak."""

from __future__ import annotations

import pytest

from router.pools import Clients


def test_in_flight_counts_and_forgets_idle_clients() -> None:
    clients = Clients()
    clients.start("a", now=0)
    clients.start("a", now=0)
    clients.finish("a")
    assert clients["a"] == 1
    clients.finish("a")
    assert clients["a"] == 0
    assert clients.load("a", now=1) == 0  # without memory


def test_a_batch_client_is_remembered_with_decay() -> None:
    clients = Clients(memory=10)
    for _ in range(100):
        clients.start("etl", now=0)
    for _ in range(100):
        clients.finish("etl")
    assert clients["etl"] == 0
    assert clients.load("etl", now=0) == pytest.approx(100)
    assert clients.load("etl", now=10) == pytest.approx(50)  # halved every 10 s
    assert clients.load("etl", now=70) < 1
    # A new burst that beats the faded peak becomes the new peak.
    for _ in range(3):
        clients.start("etl", now=70)
    assert clients.load("etl", now=70) == 3


def test_memory_is_bounded() -> None:
    clients = Clients(memory=1)
    for number in range(Clients._PURGE_AT + 5):
        clients.start(f"c{number}", now=0)
        clients.finish(f"c{number}")
    clients.start("late", now=100)  # everyone before has faded: purged
    assert len(clients._peaks) <= 6
