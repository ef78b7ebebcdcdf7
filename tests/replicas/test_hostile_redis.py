"""A Redis that misbehaves, played by a raw socket speaking RESP: it answers junk, answers in
shape but with figures no replica could have, stalls, or closes. The router's calls never wait
past `state.timeout`, take nothing it said, fall back to the replica's own view once (one log
line, one count), and the request path goes on as alone."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
from prometheus_client import CollectorRegistry

from router.backends.engines import ALONE
from router.backends.pools import Pools
from router.clock import MonotonicClock
from router.config import Backend, Classify, Health, Pool, State
from router.metrics import Metrics
from router.replicas.shared import Replicas
from router.routing.clients import Clients
from router.routing.learn import SpeedModel
from router.version import build_info

pytestmark = [pytest.mark.e2e, pytest.mark.anyio]  # a socket served on loopback

BUDGET = 0.05  # state.timeout
SYNC = 2.0  # state.sync_interval, and so the client's own socket timeout: far past the budget

# A sync answered in shape: one other replica, and its figures for backend `b1`.
GOOD_SYNC = b"*2\r\n:1\r\n*3\r\n$2\r\nb1\r\n:1\r\n:0\r\n"


@dataclass
class FakeRedis:
    """Answers each command in turn from `answers` (the last one repeats): bytes to send as they
    are, "stall" to say nothing, "close" to hang up. What it was asked is kept in `commands`."""

    answers: list[bytes | str]
    commands: list[list[bytes]] = field(default_factory=list)
    commands_answered: list[list[bytes]] = field(default_factory=list)
    port: int = 0
    connections: set[asyncio.Task[None]] = field(default_factory=set)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.connections.add(task)
        try:
            while command := await _read_command(reader):
                self.commands.append(command)
                if command[0].upper() == b"CLIENT":  # redis-py's CLIENT SETINFO on connecting
                    writer.write(b"+OK\r\n")
                    continue
                answer = self.answers[min(len(self.commands_answered), len(self.answers) - 1)]
                self.commands_answered.append(command)
                if answer == "stall":
                    await asyncio.sleep(3600)
                if answer == "close":
                    break
                assert isinstance(answer, bytes)
                writer.write(answer)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            self.connections.discard(task)


async def _read_command(reader: asyncio.StreamReader) -> list[bytes] | None:
    head = await reader.readline()
    if not head:
        return None
    assert head.startswith(b"*"), head
    parts = []
    for _ in range(int(head[1:])):
        size = int((await reader.readline())[1:])
        parts.append((await reader.readexactly(size + 2))[:-2])
    return parts


@asynccontextmanager
async def fake_redis(answers: list[bytes | str]) -> AsyncIterator[FakeRedis]:
    fake = FakeRedis(answers)
    server = await asyncio.start_server(fake.serve, "127.0.0.1", 0)
    fake.port = server.sockets[0].getsockname()[1]
    try:
        yield fake
    finally:
        server.close()
        for connection in list(fake.connections):
            connection.cancel()
        await asyncio.gather(*fake.connections, return_exceptions=True)
        await server.wait_closed()


@dataclass
class Replica:
    replicas: Replicas
    clients: Clients
    pools: Pools
    registry: CollectorRegistry

    def metric(self, name: str) -> float:
        return self.registry.get_sample_value(name) or 0.0


@asynccontextmanager
async def replica(port: int, *, sync: float = SYNC) -> AsyncIterator[Replica]:
    clock = MonotonicClock()
    pools = Pools()
    pools.configure(
        {"p": Pool(speculative=False, backends={"b1": Backend(url="http://127.0.0.1:9", max_concurrency=2)})}, Health()
    )
    clients = Clients(clock=clock)
    clients.configure(Classify(burst_hold_seconds=0))
    registry = CollectorRegistry()
    metrics = Metrics(registry, pools, SpeedModel(clock=clock), build=build_info(), clock=clock)
    replicas = Replicas(pools=pools, clients=clients, metrics=metrics, clock=clock)
    state = State(redis_url=f"redis://127.0.0.1:{port}/0", timeout=BUDGET, sync_interval=sync, ttl=5 * sync)
    replicas.configure(state, stale_after=5, memory=60)
    replicas.open()
    try:
        yield Replica(replicas, clients, pools, registry)
    finally:
        await replicas.aclose()


@asynccontextmanager
async def joined(one: Replica, fake: FakeRedis) -> AsyncIterator[None]:
    """The replica syncing in the background, joined after the fake's first answer (in shape)."""
    sync = asyncio.create_task(one.replicas.run())
    try:
        for _ in range(200):
            if one.replicas.sharing:
                break
            await asyncio.sleep(0.01)
        assert one.replicas.sharing, (one.replicas.status(), fake.commands)
        yield
    finally:
        sync.cancel()
        await asyncio.gather(sync, return_exceptions=True)


JUNK = [
    pytest.param(b"\x00\xff\xfe not RESP at all\r\n", id="not-resp"),
    pytest.param(b"*3\r\n:-5\r\n$5\r\n1.000\r\n*0\r\n", id="negative-count"),
    pytest.param(b"*3\r\n:99999999999999\r\n$5\r\n1.000\r\n*0\r\n", id="huge-count"),
    pytest.param(b"*3\r\n:1\r\n$3\r\nnan\r\n*0\r\n", id="nan-peak"),
    pytest.param(b"*3\r\n:1\r\n$4\r\n-inf\r\n*0\r\n", id="negative-peak"),
    pytest.param(b"*3\r\n:1\r\n$5\r\n1.000\r\n*2\r\n$2\r\nb1\r\n:1\r\n", id="backends-not-in-threes"),
    pytest.param(b"*3\r\n:1\r\n$5\r\n1.000\r\n*3\r\n:7\r\n:1\r\n:0\r\n", id="backend-name-a-number"),
    pytest.param(b"*2\r\n:1\r\n:2\r\n", id="too-short"),
    pytest.param(b"-ERR no such thing\r\n", id="error"),
    pytest.param(b"$-1\r\n", id="nil"),
    pytest.param(b"*1000000000\r\n", id="array-that-never-ends"),
    pytest.param("stall", id="stall"),
    pytest.param("close", id="close"),
]


@pytest.mark.parametrize("answer", JUNK)
async def test_a_request_decides_alone_when_redis_answers(
    answer: bytes | str, caplog: pytest.LogCaptureFixture
) -> None:
    async with fake_redis([GOOD_SYNC, answer]) as fake, replica(fake.port) as one, joined(one, fake):
        backend = next(one.pools.backends())
        assert backend.elsewhere.in_flight == 1
        one.clients.start("etl")
        caplog.set_level(logging.INFO, "specroute.replicas")
        loop = asyncio.get_running_loop()
        started = loop.time()
        await one.replicas.arrived("etl")  # the hostile answer
        assert loop.time() - started < SYNC / 2  # the budget, not the socket's timeout (a busy loop's slack)
        # Nothing it said was taken; the replica decides from its own view.
        assert not one.replicas.sharing
        assert one.clients.load("etl") == 1
        assert backend.elsewhere is ALONE
        assert one.metric("specroute_shared_state_up") == 0
        assert one.metric("specroute_shared_state_fallbacks_total") == 1
        status = one.replicas.status()
        assert status["sharing"] is False and status["last_error"]
        # Alone, a request asks Redis nothing and waits for nothing.
        asked = len(fake.commands_answered)
        one.clients.start("etl")
        await one.replicas.arrived("etl")
        assert await one.replicas.claim(backend, "etl")
        one.replicas.left("etl")
        assert len(fake.commands_answered) == asked
        assert one.metric("specroute_shared_state_fallbacks_total") == 1
        warnings = [r for r in caplog.records if "deciding alone" in r.getMessage()]
        assert len(warnings) == 1


# Answers to a claim for one slot, each out of shape.
CLAIM_JUNK = [
    pytest.param(b"*2\r\n*3\r\n:2\r\n:0\r\n$5\r\n1.000\r\n*0\r\n", id="grant-not-0-or-1"),
    pytest.param(b"*2\r\n*0\r\n*0\r\n", id="no-answer-for-the-claim"),
    pytest.param(b"*2\r\n*6\r\n:1\r\n:0\r\n$1\r\n1\r\n:1\r\n:0\r\n$1\r\n1\r\n*0\r\n", id="two-answers-for-one"),
    pytest.param(b"*2\r\n*3\r\n:1\r\n:-1\r\n$5\r\n1.000\r\n*0\r\n", id="negative-count"),
    pytest.param(b"*2\r\n*3\r\n:1\r\n:0\r\n$3\r\ninf\r\n*0\r\n", id="infinite-peak"),
    pytest.param(b"*2\r\n*3\r\n:1\r\n:0\r\n$1\r\n1\r\n*1\r\n:3\r\n", id="backends-not-in-threes"),
    pytest.param(b"*3\r\n:1\r\n$5\r\n1.000\r\n*0\r\n", id="a-clients-answer"),
    pytest.param("stall", id="stall"),
    pytest.param("close", id="close"),
]


@pytest.mark.parametrize("answer", CLAIM_JUNK)
async def test_a_claim_answered_junk_is_granted_alone(answer: bytes | str) -> None:
    async with fake_redis([GOOD_SYNC, answer]) as fake, replica(fake.port) as one, joined(one, fake):
        backend = next(one.pools.backends())
        one.clients.start("etl")
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await one.replicas.claim(backend, "etl")  # the slot: the replica's own to give
        assert loop.time() - started < SYNC / 2
        assert not one.replicas.sharing
        assert backend.elsewhere is ALONE and one.clients.load("etl") == 1
        assert one.metric("specroute_shared_state_fallbacks_total") == 1


@pytest.mark.parametrize("answer", JUNK)
async def test_a_sync_answered_junk_is_not_joined(answer: bytes | str) -> None:
    async with fake_redis([answer]) as fake, replica(fake.port, sync=0.2) as one:
        sync = asyncio.create_task(one.replicas.run())
        try:
            for _ in range(1000):
                if len(fake.commands_answered) >= 2:  # tried, failed, tried again
                    break
                await asyncio.sleep(0.02)
            assert not one.replicas.sharing
            assert all(b.elsewhere is ALONE for b in one.pools.backends())
            assert one.replicas.status()["last_error"]
        finally:
            sync.cancel()
            await asyncio.gather(sync, return_exceptions=True)


# A claim for one slot, granted with nothing elsewhere.
GRANTED = b"*2\r\n*3\r\n:1\r\n:0\r\n$1\r\n1\r\n*0\r\n"


@pytest.mark.parametrize("answer", CLAIM_JUNK)
async def test_slots_to_hold_answered_junk_leave_the_requests_alone(answer: bytes | str) -> None:
    """The slots a replica claims ahead of its requests (router.replicas.lease), behind them:
    an answer out of shape, or none, and it decides alone; no request waited for it."""
    async with fake_redis([GOOD_SYNC, GRANTED, answer]) as fake, replica(fake.port) as one, joined(one, fake):
        backend = next(one.pools.backends())
        one.clients.start("etl")
        assert await one.replicas.claim(backend, "etl")  # granted: b1 is used, a slot to hold is asked for
        for _ in range(200):
            if not one.replicas.sharing:
                break
            await asyncio.sleep(0.01)
        assert not one.replicas.sharing and one.replicas.status()["slots_held"] == {}
        assert one.metric("specroute_shared_state_fallbacks_total") == 1
        asked = len(fake.commands_answered)
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await one.replicas.claim(backend, "etl")
        assert loop.time() - started < BUDGET and len(fake.commands_answered) == asked
