"""A name that resolves to the router itself (router.backends.health, router.app's /health): the
router's health probe carries its own `Via`, its /health refuses such a probe with 508, and that
address never takes work. Before, the router became its own backend and sent requests to itself."""

from __future__ import annotations

import logging
import tempfile
from contextlib import ExitStack

import httpx
import pytest
from openai import OpenAI
from prometheus_client import CollectorRegistry

from router.app import create_app
from tests.backends.test_discovery import _found, _settings
from tests.dns_server import DnsServer
from tests.fake_engine import FakeEngine
from tests.servers import ServerThread, free_port, stop_together
from tests.wait import wait_until

pytestmark = pytest.mark.e2e  # the router, an engine and a DNS server on loopback


def test_a_name_resolving_to_the_router_itself_gives_no_backend_of_it(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="specroute")
    port = free_port()
    engine, team = FakeEngine(), FakeEngine()
    with DnsServer() as dns, ExitStack() as stack, tempfile.TemporaryDirectory() as store:
        servers = [
            stack.enter_context(ServerThread(engine.app(), host="127.0.0.2", port=port)),
            stack.enter_context(ServerThread(team.app())),
        ]
        stack.callback(stop_together, servers)
        # The router listens at 127.0.0.1 on the engine's port: the name gives both.
        dns.set("spec.test", "A", ["127.0.0.1", "127.0.0.2"])
        settings = _settings(f"http://spec.test:{port}", servers[1].url, store, nameservers=[dns.address])
        app = create_app(settings, registry=CollectorRegistry())
        server = stack.enter_context(ServerThread(app, fast=True, port=port))
        router = app.state.router
        itself, other = f"spec@127.0.0.1:{port}", f"spec@127.0.0.2:{port}"

        def looping() -> list[str]:
            return [r.getMessage() for r in caplog.records if "is this router itself" in r.getMessage()]

        wait_until(looping, message="the router's own address found out by its health check")
        checks = engine.health_checks
        wait_until(lambda: engine.health_checks >= checks + 3, message="three more rounds of health checks")
        assert looping() == [f"backend {itself} (pool fast) is this router itself: it takes no work"]  # once
        assert set(_found(router)) == {itself, other}
        assert not _found(router)[itself].accepting and _found(router)[other].accepting

        with OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
            for _ in range(4):
                answer = client.chat.completions.with_raw_response.create(
                    model="test-model", messages=[{"role": "user", "content": "hi"}]
                )
                assert answer.headers["x-route-backend"] == other
        assert len(engine.requests) == 4 and _found(router)[itself].sent == 0

        # Another proxy's Via is no loop; this router's own is, in OpenAI's error shape.
        assert httpx.get(server.url + "/health", headers={"via": "1.1 nginx, 1.1 specroute-other"}).status_code == 200
        refused = httpx.get(server.url + "/health", headers={"via": f"1.1 nginx, {router.via}"})
        assert refused.status_code == 508
        assert refused.json()["error"]["code"] == "loop_detected"


def test_the_router_found_again_at_a_name_is_logged_again(caplog: pytest.LogCaptureFixture) -> None:
    """What the health checks logged once of a backend is forgotten with it (router.runtime's
    `_forget`): a name that stops and starts resolving to the router says so each time, and the
    names of backends gone are not kept for the life of the process."""
    caplog.set_level(logging.INFO, logger="specroute")
    port = free_port()
    engine, team = FakeEngine(), FakeEngine()
    with DnsServer() as dns, ExitStack() as stack, tempfile.TemporaryDirectory() as store:
        servers = [
            stack.enter_context(ServerThread(engine.app(), host="127.0.0.2", port=port)),
            stack.enter_context(ServerThread(team.app())),
        ]
        stack.callback(stop_together, servers)
        dns.set("spec.test", "A", ["127.0.0.1", "127.0.0.2"])
        settings = _settings(f"http://spec.test:{port}", servers[1].url, store, nameservers=[dns.address])
        app = create_app(settings, registry=CollectorRegistry())
        stack.enter_context(ServerThread(app, fast=True, port=port))
        router = app.state.router
        itself = f"spec@127.0.0.1:{port}"

        def looping() -> int:
            return sum("is this router itself" in r.getMessage() for r in caplog.records)

        wait_until(lambda: looping() == 1, message="the router's own address found out by its health check")
        dns.set("spec.test", "A", ["127.0.0.2"])
        wait_until(lambda: itself not in _found(router), message="the router's address gone from the name")
        dns.set("spec.test", "A", ["127.0.0.1", "127.0.0.2"])
        wait_until(lambda: looping() == 2, message="the router's own address found out again")
