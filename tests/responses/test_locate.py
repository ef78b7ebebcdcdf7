"""Locate on miss: a stored response this router never saw made (another replica made it, or the
router restarted) is found by asking the backends, and the request goes where it is held.

Two routers (two apps, each its own state, as two replicas are) in front of the same two fake
engines, which store the responses they make (tests/fake_engine.py), the official `openai` SDK
as the client.
"""

from __future__ import annotations

import asyncio
import gc
import ssl
import tracemalloc
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from router.app import create_app
from router.backends.backend import Backend
from router.config import Backend as BackendConfig
from router.config import Settings
from router.responses.locate import Locator
from router.transport import EngineClient
from tests.conftest import _merge, settings_data
from tests.fake_engine import FakeEngine
from tests.servers import ServerThread

pytestmark = pytest.mark.e2e  # routers served on loopback in front of fake engines

MODEL = "test-model"


@dataclass
class Replica:
    server: ServerThread
    registry: CollectorRegistry
    clients: ExitStack

    def client(self, key: str = "client-key") -> openai.OpenAI:
        """An SDK client, closed with the replica (see tests.conftest.Cluster.client)."""
        made = openai.OpenAI(base_url=self.server.url + "/v1", api_key=key, max_retries=0, timeout=30)
        return self.clients.enter_context(made)

    def locates(self, result: str) -> float:
        return self.registry.get_sample_value("specroute_response_locates_total", {"result": result}) or 0.0


@dataclass
class Engines:
    fast: FakeEngine
    team: FakeEngine
    data: dict[str, Any]

    @contextmanager
    def replica(self, **overrides: Any) -> Iterator[Replica]:
        registry = CollectorRegistry()
        app = create_app(Settings(**_merge(self.data, overrides)), registry=registry)
        with ServerThread(app, fast=True) as server, ExitStack() as clients:
            yield Replica(server, registry, clients)

    def probes(self, engine: FakeEngine) -> list[str]:
        return [s.headers["x-request-id"] for s in engine.requests if _is_probe(s.headers)]


def _is_probe(headers: dict[str, str]) -> bool:
    return headers.get("x-request-id", "").endswith("-locate")


@pytest.fixture
def engines() -> Iterator[Engines]:
    with ExitStack() as stack:
        fast, team = FakeEngine(name="f"), FakeEngine(name="t")
        fast_url = stack.enter_context(ServerThread(fast.app())).url
        team_url = stack.enter_context(ServerThread(team.app())).url
        # Static routing: a request without a pool header goes to `fast`; probes run rarely.
        data = settings_data(fast_url, team_url, routing={"mode": "static"}, health={"interval": 60})
        yield Engines(fast, team, data)


def _made_on_team(replica: Replica) -> str:
    """A stored response made through `replica`, on the team engine (not where others go)."""
    made = replica.client().responses.create(model=MODEL, input="hi", extra_headers={"x-route-pool": "team"})
    assert made.id.startswith("resp-t")
    return made.id


def test_a_response_made_through_one_replica_is_continued_through_another(engines: Engines) -> None:
    with engines.replica() as a, engines.replica() as b:
        made = _made_on_team(a)
        # B never saw it made; routed as usual it would go to fast, which answers 404.
        follow = b.client().responses.create(model=MODEL, input="more", previous_response_id=made)
        assert follow.id.startswith("resp-t")
        assert b.locates("found") == 1
        # Found once, then remembered: no more probes for it.
        assert b.client().responses.retrieve(made).id == made
        assert b.locates("found") == 1 and b.locates("missed") == 0
        assert [s.path for s in engines.fast.requests if not _is_probe(s.headers)] == []
        # The probes went to both engines, with what the request itself carried, under their own id.
        probes = [s for s in engines.team.requests + engines.fast.requests if _is_probe(s.headers)]
        assert {(s.method, s.path) for s in probes} == {("GET", f"/v1/responses/{made}")}
        (real,) = [s for s in engines.team.requests if s.body.get("previous_response_id") == made]
        assert {s.headers.get("authorization") for s in probes} == {real.headers.get("authorization")}


@pytest.mark.parametrize("forward", [True, False])
def test_a_probe_carries_the_authorization_the_request_would(engines: Engines, forward: bool) -> None:
    with engines.replica() as a, engines.replica(forward_client_authorization=forward) as b:
        made = _made_on_team(a)
        assert b.client("client-key").responses.retrieve(made).id == made
        team = [s for s in engines.team.requests if s.path == f"/v1/responses/{made}"]
        fast = [s for s in engines.fast.requests if s.path == f"/v1/responses/{made}"]
        expected = "Bearer client-key" if forward else None
        # Team's probe, then the request itself; fast's probe is cancelled once team's found it,
        # and on a busy machine that can be before it went out.
        assert len(team) == 2 and len(fast) <= 1
        assert {s.headers.get("authorization") for s in team + fast} == {expected}


def test_a_restarted_router_finds_what_it_made_before(engines: Engines) -> None:
    with engines.replica() as before:
        made = _made_on_team(before)
    with engines.replica() as after:
        answer = httpx.get(after.server.url + f"/v1/responses/{made}", headers={"authorization": "Bearer k"})
        assert answer.status_code == 200 and answer.json()["id"] == made
        assert answer.headers["x-route-reason"] == "response_affinity"
        assert answer.headers["x-route-backend"] == "team-1"
        after.client().responses.delete(made)
        assert made not in engines.team.stored


def test_an_id_nobody_holds_is_routed_as_usual_and_not_asked_about_again_at_once(engines: Engines) -> None:
    with engines.replica() as replica:
        client = replica.client()
        for _ in range(3):
            with pytest.raises(openai.NotFoundError) as caught:
                client.responses.create(model=MODEL, input="more", previous_response_id="resp-nobody")
            # The engine's own 404, passed on; nothing of the probes.
            assert "resp-nobody" in caught.value.message
        assert replica.locates("missed") == 1 and replica.locates("cached_miss") == 2
        assert len(engines.probes(engines.fast)) == 1 and len(engines.probes(engines.team)) == 1
        answer = httpx.get(replica.server.url + "/v1/responses/resp-nobody")
        assert answer.status_code == 404 and answer.headers["x-route-reason"] != "response_affinity"


def test_an_engine_that_does_not_answer_in_time_is_no_owner_and_no_known_miss(engines: Engines) -> None:
    engines.team.stored_delay = 2.0  # silent past the locate timeout
    with engines.replica(responses={"locate_timeout": 0.2}) as replica:
        answer = httpx.get(replica.server.url + "/v1/responses/resp-t1", timeout=30)
        assert answer.status_code == 404  # fast's, routed as usual
        assert replica.locates("missed") == 1
        # Not all answered 404: not remembered as held nowhere, asked again next time.
        httpx.get(replica.server.url + "/v1/responses/resp-t1", timeout=30)
        assert replica.locates("missed") == 2 and replica.locates("cached_miss") == 0


def test_locating_can_be_turned_off(engines: Engines) -> None:
    with engines.replica() as a, engines.replica(responses={"locate_timeout": 0}) as b:
        made = _made_on_team(a)
        with pytest.raises(openai.NotFoundError):
            b.client().responses.retrieve(made)
        assert engines.probes(engines.team) == [] and engines.probes(engines.fast) == []
        assert b.locates("skipped") == 1 and b.locates("missed") == 0


def test_a_flood_of_unknown_ids_costs_the_engines_a_bounded_number_of_probes(engines: Engines) -> None:
    # Both engines slow to answer, so that the searches overlap.
    engines.fast.stored_delay = engines.team.stored_delay = 0.5
    settings = {"responses": {"locate_timeout": 2.0, "locate_concurrency": 2}}
    with engines.replica(**settings) as replica, ThreadPoolExecutor(16) as executor:
        url = replica.server.url + "/v1/responses/"
        # Sixteen requests for one id: one search, that they all wait on.
        same = list(executor.map(lambda _: httpx.get(url + "resp-same", timeout=30), range(16)))
        assert {answer.status_code for answer in same} == {404}
        assert len(engines.probes(engines.fast)) == 1 and len(engines.probes(engines.team)) == 1
        # Sixteen different ids: at most two searches at a time, the rest routed as usual at once.
        many = list(executor.map(lambda n: httpx.get(url + f"resp-other{n}", timeout=30), range(16)))
        assert {answer.status_code for answer in many} == {404}
        busy = replica.locates("busy")
        assert busy >= 1  # the bound was reached: those went on without a search
        assert len(engines.probes(engines.fast)) == 1 + 16 - busy  # one probe per search, per engine
        assert len(engines.probes(engines.team)) == 1 + 16 - busy


@pytest.mark.parametrize("named", ["../../health", "resp-1?x=1", "r" * 129])
def test_an_id_no_engine_would_make_is_not_put_in_a_probe(engines: Engines, named: str) -> None:
    with engines.replica() as replica, pytest.raises(openai.NotFoundError):
        replica.client().responses.create(model=MODEL, input="more", previous_response_id=named)
    assert engines.probes(engines.fast) == [] and engines.probes(engines.team) == []
    assert engines.fast.health_checks + engines.team.health_checks <= 2  # the router's own, at start
    assert replica.locates("skipped") == 1


def test_the_misses_remembered_hold_no_client_authorization(engines: Engines) -> None:
    # An open router (no client keys): any Authorization, up to the request head's 64 KiB. A
    # flood of unknown ids, each with another long one, must not keep those headers.
    fast = Backend("fast-1", "fast", BackendConfig(url=engines.data["pools"]["fast"]["backends"]["fast-1"]["url"]))
    count, size = 200, 60 * 1024

    async def flood() -> int:
        transport = EngineClient(connections_per_origin=4, tls=ssl.create_default_context())
        locator = Locator(transport)

        async def ask(response_id: str, credentials: str, now: float) -> tuple[str | None, str]:
            return await locator.locate(response_id, [fast], lambda _: [], credentials=credentials, now=now)

        try:
            await ask("resp-warm", "warm", 0)
            gc.collect()
            before = tracemalloc.get_traced_memory()[0]
            for n in range(count):
                assert await ask(f"resp-{n}", f"Bearer {n:08d}" + "k" * size, 0) == (None, "missed")
            # Still known as misses, for that Authorization only.
            assert await ask("resp-7", f"Bearer {7:08d}" + "k" * size, 1) == (None, "cached_miss")
            assert await ask("resp-7", "other", 1) == (None, "missed")
            gc.collect()
            return tracemalloc.get_traced_memory()[0] - before
        finally:
            await transport.aclose()

    tracemalloc.start()
    try:
        kept = asyncio.run(flood())
    finally:
        tracemalloc.stop()
    # A few hundred bytes a miss (the engine's record of each probe too, in this process), not the header.
    assert kept < count * size / 10, f"{kept} bytes kept for {count} misses"
