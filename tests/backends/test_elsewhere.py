"""A backend's figures on the other replicas (router.replicas) added to the router's own: slots,
the engine's concurrency, and the KV projection."""

from __future__ import annotations

import pytest

from router.backends.backend import Backend
from router.backends.engines import Elsewhere, EngineLoad
from router.config import Backend as BackendConfig

NOW = 100.0


def _backend(in_flight: int, elsewhere: Elsewhere, *, reading: EngineLoad | None = None) -> Backend:
    backend = Backend("b1", "p", BackendConfig(url="http://127.0.0.1:9", max_concurrency=4))
    backend.in_flight, backend.elsewhere = in_flight, elsewhere
    if reading is not None:
        backend.engine.observe(reading)
    return backend


def test_the_slots_are_the_replicas_together() -> None:
    assert _backend(2, Elsewhere(1, 0)).has_room
    assert not _backend(2, Elsewhere(2, 0)).has_room
    assert _backend(2, Elsewhere(2, 0)).load == 1.0


def test_the_engines_concurrency_counts_what_the_others_sent_since_their_reading() -> None:
    reading = EngineLoad(running=6, waiting=0, kv_usage=0.3, scraped_at=NOW, own_in_flight=2)
    # Six read, two of them this router's; one of its own since, and two of the others' since.
    assert _backend(3, Elsewhere(5, 2), reading=reading).concurrency(NOW, 5.0) == 6 + 1 + 2
    # Without a fresh reading: every request of every replica.
    assert _backend(3, Elsewhere(5, 2), reading=reading).concurrency(NOW + 10, 5.0) == 8


def test_the_kv_projection_counts_what_the_others_sent_since_their_reading() -> None:
    reading = EngineLoad(running=2, waiting=0, kv_usage=0.2, scraped_at=NOW, own_in_flight=2)
    alone = _backend(2, Elsewhere(), reading=reading).kv_projected(NOW, 5.0)
    shared = _backend(2, Elsewhere(4, 3), reading=reading).kv_projected(NOW, 5.0)
    assert alone is not None and shared is not None
    assert shared - alone == pytest.approx(3 * 0.1)  # three more requests at the reading's 0.1 each


def test_what_is_unread_here_is_what_the_last_fresh_reading_does_not_count() -> None:
    reading = EngineLoad(running=2, waiting=0, kv_usage=0.2, scraped_at=NOW, own_in_flight=2)
    backend = _backend(5, Elsewhere(), reading=reading)
    assert backend.unread(NOW, 5.0) == 3
    assert backend.unread(NOW + 10, 5.0) == 5
