"""Backends found by name (router.backends.discovery): a real DNS server on loopback
(tests/dns_server.py) answers the router, engines listen on several loopback addresses."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import random
import tempfile
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import pytest
from openai import OpenAI
from prometheus_client import CollectorRegistry, Counter

from router.app import create_app
from router.backends.backend import Address, Backend
from router.backends.discovery import SystemResolver, screen
from router.config import Settings
from router.metrics import Children
from router.runtime import Router
from tests.dns_server import DnsServer
from tests.fake_engine import FakeEngine
from tests.servers import ServerThread, free_port, stop_together
from tests.wait import wait_until

LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"),)
EVERYWHERE = (ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_network("::/0"))


@pytest.mark.parametrize(
    ("host", "port", "why"),
    [
        ("0.0.0.0", 8000, "unusable"),
        ("::", 8000, "unusable"),
        ("224.0.0.1", 8000, "unusable"),
        ("ff02::1", 8000, "unusable"),
        ("169.254.169.254", 80, "unusable"),  # a cloud's metadata service
        ("fe80::1", 8000, "unusable"),
        ("255.255.255.255", 8000, "unusable"),
        ("240.0.0.1", 8000, "unusable"),
        ("10.0.0.1", 0, "unusable"),
        ("not-an-address", 8000, "malformed"),
        ("::ffff:169.254.169.254", 80, "unusable"),  # the same, written as IPv6
    ],
)
def test_addresses_no_engine_has_are_refused(host: str, port: int, why: str) -> None:
    screened = screen([Address(host, port)], networks=EVERYWHERE, limit=8)
    assert screened.kept == []
    assert screened.refused == {why: 1}


def test_only_the_configured_networks_are_used() -> None:
    answer = [Address("10.0.0.1", 80), Address("127.0.0.2", 80), Address("::ffff:127.0.0.3", 80)]
    screened = screen(answer, networks=LOOPBACK, limit=8)
    assert screened.kept == [Address("127.0.0.2", 80), Address("127.0.0.3", 80)]
    assert screened.refused == {"network": 1}


def test_a_long_answer_keeps_the_same_lowest_addresses_in_any_order() -> None:
    answer = [Address(f"127.1.{i // 250}.{i % 250 + 1}", 8000) for i in range(600)] * 2  # repeats too
    kept = None
    for seed in range(5):
        random.Random(seed).shuffle(answer)
        screened = screen(answer, networks=LOOPBACK, limit=16)
        assert screened.refused == {"over_limit": 600 - 16}
        assert kept in (None, screened.kept)
        kept = screened.kept
    assert kept == [Address(f"127.1.0.{i}", 8000) for i in range(1, 17)]


def test_the_system_resolver_reads_the_hosts_file() -> None:
    found = asyncio.run(SystemResolver().addresses("localhost", 8000))
    assert {a.host for a in found} & {"127.0.0.1", "::1"}
    assert {a.port for a in found} == {8000}


def test_discover_needs_an_http_engine() -> None:
    with pytest.raises(ValueError, match="http:// engines only"):
        Settings.model_validate(
            {"pools": {"p": {"speculative": True, "backends": {"b": {"url": "https://x.test", "discover": "dns"}}}}}
        )


def test_forgetting_a_backend_keeps_a_pool_of_the_same_name() -> None:
    registry = CollectorRegistry()
    children = Children(Counter("c", "d", ["pool", "backend"], registry=registry))
    for pool, backend in (("team", "team"), ("fast", "team"), ("team", "t1")):
        children(pool, backend).inc()
    children.forget("team", at=1)
    assert registry.get_sample_value("c_total", {"pool": "team", "backend": "t1"}) == 1
    assert registry.get_sample_value("c_total", {"pool": "team", "backend": "team"}) is None
    assert registry.get_sample_value("c_total", {"pool": "fast", "backend": "team"}) is None
    children("team", "team").inc()  # a backend of that name again: a series of its own
    assert registry.get_sample_value("c_total", {"pool": "team", "backend": "team"}) == 1


# Serving tests: the router, engines on several loopback addresses, the DNS server.


def _settings(
    url: str, team: str, store: str, *, discover: str = "dns", conversations: bool = True, **discovery: Any
) -> Settings:
    return Settings.model_validate(
        {
            "pools": {
                "fast": {
                    "speculative": True,
                    "backends": {"spec": {"url": url, "discover": discover, "max_concurrency": 8}},
                },
                "team": {"speculative": False, "backends": {"team-1": {"url": team}}},
            },
            "discovery": {"interval": 0.1, "timeout": 0.5, "networks": ["127.0.0.0/8"], **discovery},
            "health": {"interval": 0.2},
            "routing": {"mode": "static"},
            "conversations": {"enabled": conversations},
            "batch": {"store_dir": store},
        }
    )


@contextmanager
def _router(settings: Settings, stack: ExitStack) -> Iterator[tuple[Router, OpenAI]]:
    app = create_app(settings, registry=CollectorRegistry())
    server = stack.enter_context(ServerThread(app, fast=True))
    client = OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    try:
        yield app.state.router, client
    finally:
        client.close()


def _found(router: Router) -> dict[str, Backend]:
    return {b.name: b for b in router.pools["fast"].backends}


def _series(router: Router, backend: str) -> int:
    """Series of the request path's metrics that name `backend`."""
    return sum(
        1
        for metric in router.metrics.registry.collect()
        if metric.name.startswith(("specroute_requests", "specroute_time_to_first_token", "specroute_request_duration"))
        for sample in metric.samples
        if sample.labels.get("backend") == backend
    )


def _stream(client: OpenAI, user: str, tokens: int, out: dict[str, Any]) -> None:
    stream = client.chat.completions.create(
        model="test-model", messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=tokens, user=user
    )
    chunks = [chunk for chunk in stream if chunk.choices]
    out[user] = (sum(1 for c in chunks if c.choices[0].delta.content), chunks[-1].choices[0].finish_reason)


def _streams(client: OpenAI, users: list[str], tokens: int) -> tuple[list[threading.Thread], dict[str, Any]]:
    out: dict[str, Any] = {}
    threads = [threading.Thread(target=_stream, args=(client, user, tokens, out)) for user in users]
    for thread in threads:
        thread.start()
    return threads, out


@pytest.mark.e2e
def test_a_name_that_gains_and_loses_addresses_cuts_no_stream(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="specroute")
    port = free_port()
    a, b = FakeEngine(token_delay=0.05), FakeEngine(token_delay=0.05)
    team = FakeEngine()
    with DnsServer() as dns, ExitStack() as stack, tempfile.TemporaryDirectory() as store:
        servers = [
            stack.enter_context(ServerThread(a.app(), host="127.0.0.2", port=port)),
            stack.enter_context(ServerThread(b.app(), host="127.0.0.3", port=port)),
            stack.enter_context(ServerThread(team.app())),
        ]
        stack.callback(stop_together, servers)
        dns.set("spec.test", "A", ["127.0.0.2"])
        settings = _settings(f"http://spec.test:{port}", servers[2].url, store, nameservers=[dns.address])
        router, client = stack.enter_context(_router(settings, stack))
        first, second = f"spec@127.0.0.2:{port}", f"spec@127.0.0.3:{port}"
        assert set(_found(router)) == {first} and _found(router)[first].accepting

        # Four long streams on the first address; then the name moves to the second.
        long, done = _streams(client, [f"long-{i}" for i in range(4)], tokens=40)
        wait_until(lambda: a.open == 4, message="four streams on the first engine")
        dns.set("spec.test", "A", ["127.0.0.3"])
        wait_until(lambda: second in _found(router) and _found(router)[second].accepting, message="second found")
        assert b.health_checks >= 1  # checked before it took any work
        assert _found(router)[first].gone and not _found(router)[first].accepting
        assert a.open == 4

        # New work goes to the new backend only, while the old one's streams run on.
        short, served = _streams(client, [f"short-{i}" for i in range(3)], tokens=2)
        for thread in short:
            thread.join(timeout=30)
        assert served == {f"short-{i}": (2, "length") for i in range(3)}
        assert (len(a.requests), len(b.requests)) == (4, 3)
        for thread in long:
            thread.join(timeout=30)
        assert done == {f"long-{i}": (40, "length") for i in range(4)}  # not one token lost
        assert a.aborted == 0
        assert _series(router, first) > 0
        wait_until(lambda: first not in _found(router), message="the drained backend removed once idle")
        wait_until(lambda: _series(router, first) == 0, message="its series forgotten a refresh after its removal")

        # It comes back: a new backend, checked again, that takes its share of the load.
        checks = a.health_checks
        dns.set("spec.test", "A", ["127.0.0.3", "127.0.0.2"])
        wait_until(lambda: first in _found(router) and _found(router)[first].accepting, message="first found again")
        assert a.health_checks > checks
        again, served = _streams(client, [f"again-{i}" for i in range(4)], tokens=10)
        for thread in again:
            thread.join(timeout=30)
        assert len(served) == 4
        assert len(a.requests) > 4 and len(b.requests) > 3
    messages = [record.getMessage() for record in caplog.records if record.name.startswith("specroute")]
    assert f"backend {first} (pool fast) drained: spec.test no longer resolves to it" in messages
    assert f"backend {first} (pool fast) removed: drained" in messages


@pytest.mark.e2e
def test_hostile_answers_are_bounded_and_failures_keep_the_backends(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="specroute")
    port = free_port()
    team = FakeEngine()
    with DnsServer() as dns, ExitStack() as stack, tempfile.TemporaryDirectory() as store:
        team_server = stack.enter_context(ServerThread(team.app()))
        # Hundreds of addresses (nothing listens on them: loopback refuses), one outside the
        # allowed networks, and addresses no engine has.
        many = [f"127.1.{i // 250}.{i % 250 + 1}" for i in range(300)]
        dns.set("spec.test", "A", [*many, "10.0.0.1", "0.0.0.0", "224.0.0.1", "169.254.169.254"])
        settings = _settings(
            f"http://spec.test:{port}", team_server.url, store, nameservers=[dns.address], max_addresses=16
        )
        router, _ = stack.enter_context(_router(settings, stack))
        registry = router.metrics.registry

        def refused(why: str) -> float:
            labels = {"pool": "fast", "backend": "spec", "why": why}
            return registry.get_sample_value("specroute_discovery_refused_addresses_total", labels) or 0.0

        expected = {f"spec@127.1.0.{i}:{port}" for i in range(1, 17)}
        assert set(_found(router)) == expected
        assert refused("over_limit") >= 284 and refused("network") >= 1 and refused("unusable") >= 3

        def answers(result: str) -> float:
            labels = {"pool": "fast", "backend": "spec", "result": result}
            return registry.get_sample_value("specroute_discovery_answers_total", labels) or 0.0

        # A server that fails, is silent, or sends what is no answer: the backends stay.
        for fault in ("servfail", "nxdomain", "garbage", "wrong_id", "silent"):
            failed = answers("failed")
            dns.fault = fault
            wait_until(lambda: answers("failed") >= failed + 2, message=f"{fault} counted")  # noqa: B023
            assert set(_found(router)) == expected and not any(b.gone for b in _found(router).values())
        dns.fault = None
        # An answer of nothing usable changes nothing either.
        dns.set("spec.test", "A", ["0.0.0.0", "10.0.0.1"])
        empty = answers("empty")
        wait_until(lambda: answers("empty") >= empty + 2, message="empty answers counted")
        assert set(_found(router)) == expected

        # Flapping among ever new addresses: the pool never holds more than the limit (none has
        # requests running), and what is removed is forgotten.
        for round_ in range(20):
            fresh = [f"127.2.{round_}.{i}" for i in range(1, 17)]
            dns.set("spec.test", "A", fresh)
            names = {f"spec@{address}:{port}" for address in fresh}
            wait_until(
                lambda: {b.name for b in _found(router).values() if not b.gone} == names,  # noqa: B023
                message="the new answer taken",
            )
            assert len(router.pools["fast"].backends) <= 32
        wait_until(lambda: len(router.pools["fast"].backends) == 16, message="the gone ones removed")
        gone_series = [
            sample
            for metric in registry.collect()
            if metric.name == "specroute_backend_gone"
            for sample in metric.samples
        ]
        assert len(gone_series) == 16
    warnings = [r.getMessage() for r in caplog.records if r.name == "specroute.discovery" and r.levelname == "WARNING"]
    # Each failure is logged when it starts, not at every interval.
    assert sum("does not resolve" in message for message in warnings) <= 5


@pytest.mark.e2e
def test_srv_records_give_each_engine_its_port() -> None:
    a, b, team = FakeEngine(), FakeEngine(), FakeEngine()
    with DnsServer() as dns, ExitStack() as stack, tempfile.TemporaryDirectory() as store:
        servers = [stack.enter_context(ServerThread(engine.app())) for engine in (a, b, team)]
        stack.callback(stop_together, servers)
        dns.set(
            "_http._tcp.spec.test",
            "SRV",
            [f"0 10 {servers[0].port} a.spec.test.", f"0 10 {servers[1].port} b.spec.test.", "1 10 9 c.spec.test."],
        )
        dns.set("a.spec.test", "A", ["127.0.0.1"])
        dns.set("b.spec.test", "A", ["127.0.0.1"])
        dns.set("c.spec.test", "A", ["127.0.0.9"])  # a lower priority: not used while the others are there
        # Conversations off: four users sending one prompt would be kept where its prefix is cached.
        settings = _settings(
            "http://_http._tcp.spec.test",
            servers[2].url,
            store,
            discover="srv",
            conversations=False,
            nameservers=[dns.address],
        )
        router, client = stack.enter_context(_router(settings, stack))
        assert set(_found(router)) == {f"spec@127.0.0.1:{servers[0].port}", f"spec@127.0.0.1:{servers[1].port}"}
        # Four streams at once, held by the engines until all four run: the least loaded takes
        # each, two each. (Unheld, on a busy machine one stream could end before the next was
        # sent, and an idle pool sends every one to its first backend.)
        a.stream_gate = b.stream_gate = gate = threading.Event()
        threads, served = _streams(client, [f"u{i}" for i in range(4)], tokens=20)
        wait_until(lambda: a.open + b.open == 4, message="four streams running")
        gate.set()
        for thread in threads:
            thread.join(timeout=30)
        assert served == {f"u{i}": (20, "length") for i in range(4)}
        assert (len(a.requests), len(b.requests)) == (2, 2)


@pytest.mark.e2e
def test_the_system_resolver_finds_an_engine_by_name() -> None:
    engine, team = FakeEngine(), FakeEngine()
    with ExitStack() as stack, tempfile.TemporaryDirectory() as store:
        servers = [stack.enter_context(ServerThread(e.app())) for e in (engine, team)]
        stack.callback(stop_together, servers)
        settings = _settings(f"http://localhost:{servers[0].port}", servers[1].url, store)
        router, client = stack.enter_context(_router(settings, stack))
        assert f"spec@127.0.0.1:{servers[0].port}" in _found(router)
        answer = client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi"}])
        assert answer.choices[0].message.content and engine.requests


@pytest.mark.e2e
def test_an_answer_refusing_more_or_fewer_each_time_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="specroute")
    port = free_port()
    with DnsServer() as dns, ExitStack() as stack, tempfile.TemporaryDirectory() as store:
        team = stack.enter_context(ServerThread(FakeEngine().app()))
        dns.set("spec.test", "A", ["127.0.0.2"])
        settings = _settings(f"http://spec.test:{port}", team.url, store, nameservers=[dns.address], max_addresses=4)
        router, _ = stack.enter_context(_router(settings, stack))

        def ok() -> float:
            labels = {"pool": "fast", "backend": "spec", "result": "ok"}
            return router.metrics.registry.get_sample_value("specroute_discovery_answers_total", labels) or 0.0

        # A round-robin server handing out a few more or fewer each time, some outside the networks.
        for round_ in range(6):
            extra = 2 + round_ % 2
            dns.set("spec.test", "A", [f"127.0.3.{i}" for i in range(1, 5 + extra)] + ["10.0.0.1"] * (round_ % 2))
            answered = ok()
            wait_until(lambda: ok() >= answered + 2, message="the answer taken")  # noqa: B023
            dns.set("spec.test", "A", [f"127.0.3.{i}" for i in range(1, 5)])  # and nothing refused between
            answered = ok()
            wait_until(lambda: ok() >= answered + 2, message="the answer taken")  # noqa: B023
    warnings = [r.getMessage() for r in caplog.records if r.name == "specroute.discovery" and r.levelname == "WARNING"]
    assert [m for m in warnings if "not used" in m] == [
        "backend spec (pool fast): spec.test gave addresses that are not used: 2 over_limit",
        "backend spec (pool fast): spec.test gave addresses that are not used: 1 network, 3 over_limit",
    ]
