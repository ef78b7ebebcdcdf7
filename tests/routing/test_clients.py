"""Each client's requests in flight, and the fading memory of its recent peak."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from router.clock import ManualClock
from router.config import PLACEHOLDER_KEYS, Classify
from router.routing.clients import Clients, Placeholders, ProxyNotice, client_id, key_hash


def _clients(clock: ManualClock, **config: Any) -> Clients:
    clients = Clients(clock=clock)
    clients.configure(Classify(**config))
    return clients


def test_in_flight_counts_and_forgets_idle_clients() -> None:
    clock = ManualClock()
    clients = _clients(clock, client_memory_seconds=0)
    clients.start("a")
    clients.start("a")
    clients.finish("a")
    assert clients["a"] == 1
    clients.finish("a")
    assert clients["a"] == 0
    clock.advance(1)
    assert clients.load("a") == 0  # without memory


def test_a_batch_client_is_remembered_with_decay() -> None:
    clock = ManualClock()
    clients = _clients(clock, client_memory_seconds=10)
    for _ in range(100):
        clients.start("etl")
    for _ in range(100):
        clients.finish("etl")
    assert clients["etl"] == 0
    assert clients.load("etl") == pytest.approx(100)
    clock.advance(10)
    assert clients.load("etl") == pytest.approx(50)  # halved every 10 s
    clock.advance(60)
    assert clients.load("etl") < 1
    # A new burst that beats the faded peak becomes the new peak.
    for _ in range(3):
        clients.start("etl")
    assert clients.load("etl") == 3


def test_memory_is_bounded() -> None:
    clock = ManualClock()
    clients = _clients(clock, client_memory_seconds=1)
    for number in range(Clients._PURGE_AT + 5):
        clients.start(f"c{number}")
        clients.finish(f"c{number}")
    assert len(clients._peaks) <= Clients._PURGE_AT
    clock.advance(100)
    for number in range(Clients._PURGE_AT // 2 + 1):
        clients.start(f"late{number}")  # everyone before has faded: purged at the cap
    assert len(clients._peaks) <= Clients._PURGE_AT // 2 + 1
    assert not any(client.startswith("c") for client in clients._peaks)


def test_a_flood_of_live_clients_is_bounded() -> None:
    """Hostile: distinct clients, each with two requests in flight at once (a peak that has not
    faded), faster than the memory fades. The least recently seen idle ones go; a batch job with
    requests in flight keeps its peak."""
    clock = ManualClock()
    clients = _clients(clock, client_memory_seconds=60)
    for _ in range(50):
        clients.start("etl")
    purges = 0
    purge = clients._purge

    def counted(now: float) -> None:
        nonlocal purges
        purges += 1
        purge(now)

    clients._purge = counted  # type: ignore[method-assign]
    for number in range(3 * Clients._PURGE_AT):
        clock.advance(0.001)
        for _ in range(2):
            clients.start(f"k{number}")
        for _ in range(2):
            clients.finish(f"k{number}")
        assert len(clients._peaks) <= Clients._PURGE_AT
    assert purges <= 6  # once per half the cap's new clients, not once per client
    assert clients.load("etl") == 50
    assert clients.load(f"k{3 * Clients._PURGE_AT - 1}") > 1  # the latest are remembered


@pytest.mark.anyio
async def test_a_new_clients_burst_is_held_until_it_shows_itself() -> None:
    import asyncio

    clients = _clients(ManualClock(), client_memory_seconds=0, burst_hold_seconds=30.0, batch_inflight_threshold=4)
    seen: list[float] = []

    async def request() -> None:
        new = clients.start("etl")
        await clients.settle("etl", new=new)
        seen.append(clients.load("etl") - 1)  # what the classifier would see: the others

    tasks = [asyncio.create_task(request()) for _ in range(6)]
    await asyncio.wait_for(asyncio.gather(*tasks), 10)  # released by the burst, not the 30 s hold
    assert min(seen) >= 4  # every one of them, the first included, sees a batch job


@pytest.mark.anyio
async def test_a_client_not_seen_lately_is_held_however_fine_the_clock() -> None:
    """With the memory on, a new client's first request is held even on a clock that has not
    moved since it arrived (a coarse one, or a test's); it was not: its own start counted as a
    peak of exactly 1, which read as seen lately. One seen lately is not held."""
    import asyncio

    clients = _clients(ManualClock(), client_memory_seconds=60, burst_hold_seconds=30.0, batch_inflight_threshold=4)
    held = asyncio.create_task(clients.settle("new", new=clients.start("new")))
    await asyncio.sleep(0)
    assert not held.done()
    held.cancel()
    with pytest.raises(asyncio.CancelledError):
        await held
    for _ in range(3):
        clients.start("etl")
    for _ in range(3):
        clients.finish("etl")
    settle = clients.settle("etl", new=clients.start("etl"))  # a moment after a burst of three
    with pytest.raises(StopIteration):
        settle.send(None)  # done at its first step: it never waited


@pytest.mark.anyio
async def test_a_lone_first_request_waits_only_the_hold() -> None:
    import asyncio
    import time

    clients = _clients(ManualClock(), client_memory_seconds=0, burst_hold_seconds=0.05, batch_inflight_threshold=4)
    new = clients.start("dev")
    started = time.monotonic()
    await asyncio.wait_for(clients.settle("dev", new=new), 10)  # the hold ends by itself
    assert time.monotonic() - started >= 0.05
    settle = clients.settle("dev", new=clients.start("dev"))  # a second request while the first runs: no hold
    with pytest.raises(StopIteration):
        settle.send(None)  # done at its first step: it never waited


@pytest.mark.anyio
async def test_a_user_seen_lately_with_one_request_at_a_time_is_not_held_again() -> None:
    """Only a client not seen lately is held: an interactive user sending one request at a time
    waits the hold once, not on every request (its peak of 1 read as never seen, so each of its
    requests waited the 20 ms hold before its first token)."""
    import asyncio

    clock = ManualClock()
    clients = _clients(clock, client_memory_seconds=60, burst_hold_seconds=30.0, batch_inflight_threshold=4)
    first = asyncio.create_task(clients.settle("dev", new=clients.start("dev")))
    await asyncio.sleep(0)
    assert not first.done()  # new: held
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    clients.finish("dev")
    for _ in range(3):  # its next requests, one at a time, seconds apart
        clock.advance(5)
        settle = clients.settle("dev", new=clients.start("dev"))
        with pytest.raises(StopIteration):
            settle.send(None)  # done at its first step: it never waited
        clients.finish("dev")
    clock.advance(5 * 60)  # faded: a client not seen lately again
    again = asyncio.create_task(clients.settle("dev", new=clients.start("dev")))
    await asyncio.sleep(0)
    assert not again.done()
    again.cancel()
    with pytest.raises(asyncio.CancelledError):
        await again


def test_a_key_is_kept_only_as_its_hash() -> None:
    client = client_id("sk-team-secret-1234", None, "10.0.0.1")
    assert "sk-team-secret-1234" not in client
    assert client == f"key:{key_hash('sk-team-secret-1234')} addr:10.0.0.1"
    assert key_hash("sk-a") != key_hash("sk-b")


@pytest.mark.parametrize(
    ("key", "placeholder"),
    [
        ("none", True),
        ("EMPTY", True),
        ("  None ", True),
        ("", True),
        ("sk-no-key-required", True),
        ("sk-placeholder-1234", True),
        ("sk-xxxxxxxx", True),
        ("ollama", True),
        ("sk-proj-8c1f0e2a9b", False),
        ("team-a-7f3e", False),
        ("nonesuch-key-42", False),
    ],
)
def test_placeholder_keys(key: str, placeholder: bool) -> None:
    assert (key in Placeholders(list(PLACEHOLDER_KEYS))) is placeholder


def test_a_proxy_not_trusted_is_warned_of_once(caplog: pytest.LogCaptureFixture) -> None:
    notice = ProxyNotice()
    with caplog.at_level(logging.WARNING, logger="specroute"):
        notice.check("10.0.0.9", None)  # no proxy header: nothing to say
        notice.check("10.0.0.5", "203.0.113.7, 10.0.0.5")  # trusted: uvicorn took the header
        assert not caplog.records
        notice.check("10.0.0.9", "203.0.113.7")
        notice.check("10.0.0.9", "203.0.113.8")
    assert len(caplog.records) == 1
    assert "10.0.0.9" in caplog.records[0].getMessage()
    assert "forwarded_allow_ips" in caplog.records[0].getMessage()


def test_proxy_warnings_are_bounded() -> None:
    notice = ProxyNotice()
    for number in range(ProxyNotice._MAX * 4):
        notice.check(f"10.1.{number // 256}.{number % 256}", "203.0.113.7")
    assert len(notice._warned) == ProxyNotice._MAX


def test_what_the_other_replicas_have_counts_as_this_ones() -> None:
    clock = ManualClock()
    clients = _clients(clock, client_memory_seconds=10)
    clients.start("etl")
    clients.start("etl")
    clients.share("etl", elsewhere=3, peak=4.0)
    assert clients.load("etl") == 5  # two here, three elsewhere
    clients.alone()  # the store failed: this replica's own view, and what it remembered
    assert clients.load("etl") == 5
    clock.advance(10)
    assert clients.load("etl") == 2.5  # the peak of five, halved once
    clients.finish("etl")
    clients.finish("etl")
    clients.share("etl", elsewhere=50, peak=50.0)  # of a client with nothing here: not kept
    assert clients.load("etl") == 2.5


def test_a_shared_peak_is_remembered_here() -> None:
    clock = ManualClock()
    clients = _clients(clock, client_memory_seconds=10)
    clients.start("etl")
    clients.share("etl", elsewhere=0, peak=8.0)  # the job's peak, seen by the others
    clients.finish("etl")
    assert clients.load("etl") == 8
    assert not clients.start("etl")  # not new: no hold for its next burst


@pytest.mark.anyio
async def test_a_burst_split_between_replicas_ends_the_hold_once_it_shows_in_all() -> None:
    import asyncio

    clients = _clients(ManualClock(), client_memory_seconds=0, burst_hold_seconds=30.0, batch_inflight_threshold=4)
    new = clients.start("etl")
    second = clients.start("etl")  # arrived before the first one settles: held with it
    held = [asyncio.create_task(clients.settle("etl", new=flag)) for flag in (new, second)]
    await asyncio.sleep(0)
    assert not any(task.done() for task in held)
    clients.share("etl", elsewhere=2, peak=4.0)  # four in all: not more than the threshold yet
    await asyncio.sleep(0)
    assert not any(task.done() for task in held)
    clients.share("etl", elsewhere=3, peak=5.0)  # five: the burst shows
    assert await asyncio.wait_for(asyncio.gather(*held), 10) == [True, True]
    assert clients.load("etl") - 1 >= 4
