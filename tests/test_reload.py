"""Every setting either reaches the part that uses it on a reload, or is named as needing a restart.

The table below has one row for each leaf of `router.config.Settings`: the value a reload
changes it to, and what to look at on a running `Router` to see the change — the behaviour of
the request path's plan (a classification, a routing decision, a key check); what a fake
engine behind backend f1 sees of the router (how often it is probed or scraped, when the
router gives up on it, how often it is asked for its models); what /metrics and /router/status
show as the injected clock moves; or the value a part publicly holds (never a private
attribute, never the settings). A setting added to config.py without a row here fails
`test_every_setting_has_a_row`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import typing
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import trustme
from pydantic import BaseModel

from router.backends.engines import EngineLoad
from router.batch.service import BatchService
from router.clock import ManualClock
from router.config import Settings
from router.errors import RouterError
from router.request.decide import content_kind
from router.routing.classify import Classification, RequestFacts
from router.routing.policy import PoolState
from router.runtime import NEEDS_RESTART, Router
from router.status import status
from tests.fake_engine import FakeEngine
from tests.servers import ServerThread
from tests.wait import until, wait_until

Observe = Callable[[Router], Any]


class WithEngine(NamedTuple):
    """A row that looks at what the engine behind backend f1 (a fake one) saw of the router."""

    observe: Callable[[Router, FakeEngine], Any]


ENGINE = "<engine>"  # the fake engine's address, filled in by the test

BASE: dict[str, Any] = {
    "pools": {
        "fast": {"speculative": True, "backends": {"f1": {"url": ENGINE, "max_concurrency": 8}}},
        "team": {"speculative": False, "backends": {"t1": {"url": "http://127.0.0.1:2"}}},
    },
    "classify": {"rules": [], "client_memory_seconds": 10},
    "fairness": {"groups": {"g": {"keys_env": "SPECROUTE_TEST_GROUP_KEYS", "max_in_flight": 100}}},
}


def _leaves(model: type[BaseModel], prefix: str = "") -> Iterator[str]:
    """Dotted names of every leaf setting; a map of sections (pools, backends) is `*`."""
    for name, field in model.model_fields.items():
        annotation = field.annotation
        args = typing.get_args(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _leaves(annotation, f"{prefix}{name}.")
        elif typing.get_origin(annotation) is dict and isinstance(args[1], type) and issubclass(args[1], BaseModel):
            yield from _leaves(args[1], f"{prefix}{name}.*.")
        else:
            yield prefix + name


# Helpers that show behaviour.


def _classify(router: Router, headers: dict[str, str] | None = None, **facts: Any) -> Classification:
    return router.plan.classifier.classify(RequestFacts(headers=headers or {}, **facts))


def _route(router: Router, job: str = "interactive", *, spec: PoolState, std: PoolState) -> str:
    decision = router.plan.policy.decide(Classification(job, "default"), "prose", {"fast": spec, "team": std})  # type: ignore[arg-type]
    return decision.pool


def _limits(router: Router, group: str | None) -> Any:
    """The limits a request of key `k` in `group` is held to, and what it counts against."""
    admitted = router.limiter.admit(client="key:k addr:a", key="k", group=group, prompt_tokens=1, now=0.0)
    return (admitted.subject, admitted.quota) if admitted is not None else None


def _raised(call: Callable[[], Any]) -> str | None:
    try:
        call()
    except RouterError as exc:
        return exc.code
    return None


def _remembered(router: Router) -> float:
    """A client's peak of 4, 10 s later, as the in-flight heuristic sees it."""
    clock = router.clock
    assert isinstance(clock, ManualClock)
    for _ in range(4):
        router.clients.start("c")
    for _ in range(4):
        router.clients.finish("c")
    clock.advance(10)
    return router.clients.load("c")


def _backend(router: Router) -> Any:
    return router.pools["fast"].backends[0]


def _held(router: Router) -> bool:
    """Whether a new client's lone first request is still held after a second (the default hold
    is 0.02 s; the row sets 5 s). Only the event loop's time passes here."""

    newcomer = f"newcomer-{uuid.uuid4()}"  # a client the router has not seen

    async def hold() -> bool:
        settling = asyncio.ensure_future(router.clients.settle(newcomer, new=router.clients.start(newcomer)))
        done, _ = await asyncio.wait([settling], timeout=1.0)
        settling.cancel()
        return not done

    return asyncio.run(hold())


def _router(settings: Settings) -> Router:
    """A router as the app builds one, with the Batch API's parts (their store not opened)."""
    return Router(settings, clock=ManualClock(), batches=lambda r: BatchService(r, clock=lambda: 0.0))


def _batches(router: Router) -> BatchService:
    assert isinstance(router.batches, BatchService)
    return router.batches


def _owner_after(router: Router, seconds: float, *, others: int = 0) -> str | None:
    """Who owns a stored response `seconds` after it was made, with `others` made after it."""
    clock = router.clock
    assert isinstance(clock, ManualClock)
    router.owners.remember("resp-first", "f1", clock.now())
    for n in range(others):
        router.owners.remember(f"resp-{n}", "f1", clock.now())
    clock.advance(seconds)
    return router.owners.owner("resp-first", clock.now())


def _engine_metrics(router: Router, reading: EngineLoad, *, age: float) -> dict[str, float]:
    """The fast backend's engine figures in /metrics and /router/status, `age` seconds after one scrape."""
    clock = router.clock
    assert isinstance(clock, ManualClock)
    _backend(router).engine.observe(dataclasses.replace(reading, scraped_at=clock.now()))
    clock.advance(age)
    labels = {"pool": "fast", "backend": "f1"}
    shown = {
        name: value
        for name in ("specroute_engine_scrape_stale", "specroute_engine_spec_acceptance_ratio")
        if (value := router.metrics.registry.get_sample_value(name, labels)) is not None
    }
    live = status(router.plan, router.pools, router.speeds, now=clock.now())
    shown["status_stale"] = live["pools"]["fast"]["backends"]["f1"]["engine"]["stale"]
    return shown


def _reaches(router: Router, run: Callable[[], Awaitable[Any]], condition: Callable[[], bool], seconds: float) -> bool:
    """Whether `condition` holds within `seconds` while `run` runs."""

    async def watch() -> bool:
        task = asyncio.ensure_future(run())
        try:
            await until(condition, timeout=seconds)
            return True
        except AssertionError:
            return False
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await router.transport.aclose()  # its connections belong to this event loop

    return asyncio.run(watch())


def _finishes(router: Router, run: Callable[[], Awaitable[Any]], seconds: float) -> bool:
    done: list[bool] = []

    async def record() -> None:
        await run()
        done.append(True)

    return _reaches(router, record, lambda: bool(done), seconds)


def _probes_often(router: Router, engine: FakeEngine) -> bool:
    """Whether the health checker probes the engine twice within 2 s (every 5 s by default)."""
    start = engine.health_checks
    return _reaches(router, router.health.run, lambda: engine.health_checks >= start + 2, 2.0)


def _scrapes_often(router: Router, engine: FakeEngine) -> bool:
    """Whether the scraper reads the engine's /metrics three times within 0.8 s (every second by default)."""
    engine.metrics = ""
    start = engine.metrics_served
    return _reaches(router, router.scraper.run, lambda: engine.metrics_served >= start + 3, 0.8)


def _reads_a_page_of_2_kb(router: Router, engine: FakeEngine) -> bool:
    """Whether a scrape reads a `/metrics` page of 2 KB (up to 4 MiB by default)."""
    running = engine.metrics_served + 100  # another figure at each look
    engine.metrics = "# " + "x" * 2048 + f"\nvllm:num_requests_running {running}\n"
    _finishes(router, router.scraper.scrape_all, 5.0)
    return bool(_backend(router).engine.reading.running == running)


def _slow_engine_given_up(router: Router, engine: FakeEngine, *parts: Callable[[], Awaitable[Any]]) -> list[bool]:
    """Whether each part gives up on an engine that answers in 1 s, within 0.4 s (the default
    scrape timeout is 0.5 s, the probes' and model lists' 2 s)."""
    engine.probe_delay = 1.0
    return [_finishes(router, part, 0.4) for part in parts]


def _model_lists_fetched(router: Router, engine: FakeEngine) -> int:
    """How many times the engine is asked for its models when clients ask 2 s apart (cached 5 s by default)."""
    clock = router.clock
    assert isinstance(clock, ManualClock)
    start = engine.models_served

    async def twice() -> None:
        await router.catalog.models()
        clock.advance(2)
        await router.catalog.models()
        await router.transport.aclose()

    asyncio.run(twice())
    return engine.models_served - start


IDLE = PoolState(speculative=True, concurrency=0)
PAST_CROSSOVER = PoolState(speculative=True, concurrency=10)

# setting -> (the value a reload sets, what shows it)
RELOADABLE: dict[str, tuple[Any, Observe | WithEngine]] = {
    "pools.*.speculative": (False, lambda r: r.pools["fast"].speculative),
    "pools.*.backends.*.url": ("http://127.0.0.1:3", lambda r: _backend(r).url),
    "pools.*.backends.*.api_key_env": ("SPECROUTE_TEST_ENGINE_KEY", lambda r: _backend(r).auth_headers),
    "pools.*.backends.*.max_concurrency": (2, lambda r: _backend(r).max_concurrency),
    "pools.*.queue_size": (3, lambda r: r.pools["fast"].queue_size),
    "pools.*.queue_timeout": (3.0, lambda r: r.pools["fast"].queue_timeout),
    "pools.*.priority_scheduling": (True, lambda r: r.pools["fast"].priority_scheduling),
    "pools.*.prior_speed": ({"prose": {1: 50.0}}, lambda r: r.speeds.prior("f1", "prose")),
    "headers.pool": ("X-Pool", lambda r: _classify(r, {"x-pool": "team"}).pinned_pool),
    "headers.ttft_target": ("X-Deadline-Ms", lambda r: r.plan.ttft.of({"x-deadline-ms": "500"})),
    "headers.job": ("X-Job", lambda r: _classify(r, {"x-job": "batch"}).job),
    "classify.rules": (
        [{"name": "evals", "job": "batch", "match": {"model": "glm-batch"}}],
        lambda r: _classify(r, model="glm-batch").job,
    ),
    "classify.batch_inflight_threshold": (2, lambda r: _classify(r, client_load=2).job),
    "classify.client_memory_seconds": (5, _remembered),
    "classify.burst_hold_seconds": (5.0, _held),
    "classify.placeholder_keys": (["team-key"], lambda r: "team-key" in r.plan.placeholders),
    "classify.code_hints": (["frobnicate"], lambda r: content_kind({}, r.plan.code_hints, text="frobnicate it")),
    "fairness.fair_share": (False, lambda r: r.pools["fast"].fair_share),
    "fairness.keep_room": (False, lambda r: r.pools["fast"].active.keep_room),
    "fairness.active_window": (5.0, lambda r: r.pools["fast"].active.window),
    "fairness.newcomer_slots": (9, lambda r: r.pools["fast"].newcomers.slots),
    "fairness.top_clients": (3, lambda r: r.plan.top_clients),
    "fairness.groups.*.keys_env": ("SPECROUTE_TEST_CLIENT_KEYS", lambda r: r.plan.groups.of("client-key")),
    "fairness.groups.*.weight": (3.0, lambda r: r.plan.groups.weight("g")),
    "fairness.groups.*.shared": (True, lambda r: _limits(r, "g")),
    "fairness.groups.*.requests_per_minute": (5, lambda r: _limits(r, "g")),
    "fairness.groups.*.tokens_per_minute": (500, lambda r: _limits(r, "g")),
    "fairness.groups.*.max_in_flight": (5, lambda r: _limits(r, "g")),
    "fairness.default_limits.requests_per_minute": (5, lambda r: _limits(r, None)),
    "fairness.default_limits.tokens_per_minute": (500, lambda r: _limits(r, None)),
    "fairness.default_limits.max_in_flight": (5, lambda r: _limits(r, None)),
    "routing.interactive_pool": ("team", lambda r: _route(r, spec=IDLE, std=IDLE)),
    "routing.batch_pool": ("fast", lambda r: _route(r, "batch", spec=IDLE, std=IDLE)),
    "routing.mode": ("static", lambda r: _route(r, spec=PAST_CROSSOVER, std=PoolState(speculative=False))),
    "routing.crossover": ({"prose": 50, "code": 50}, lambda r: _route(r, spec=PAST_CROSSOVER, std=IDLE)),
    "routing.kv_threshold": (0.5, lambda r: _route(r, spec=PoolState(True, kv_usage=0.6), std=IDLE)),
    "routing.batch_may_use_speculative": (
        True,
        lambda r: _route(r, "batch", spec=IDLE, std=PoolState(speculative=False, has_room=False)),
    ),
    "routing.ttft_target_min": (1.0, lambda r: r.plan.ttft.of({"x-slo-ttft-ms": "10"})),
    "routing.ttft_target_max": (1.0, lambda r: r.plan.ttft.of({"x-slo-ttft-ms": "5000"})),
    "routing.reject_unmeetable_ttft": (True, lambda r: r.plan.ttft.reject_unmeetable),
    "routing.ttft_target": (5.0, lambda r: _route(r, spec=PAST_CROSSOVER, std=PoolState(False, ttft=4.0))),
    "timeouts.connect": (1.0, lambda r: r.plan.timeouts.connect),
    "timeouts.read": (0.3, lambda r: r.plan.timeouts.read),
    "timeouts.idle": (2.0, lambda r: r.plan.timeouts.idle),
    "timeouts.client_body": (2.0, lambda r: r.plan.client_body_seconds),
    "health.interval": (0.2, WithEngine(_probes_often)),
    "health.timeout": (
        0.1,
        WithEngine(lambda r, e: _slow_engine_given_up(r, e, r.health.check_all, r.catalog.models)),
    ),
    "health.unhealthy_after": (5, lambda r: _backend(r).outlier.config.unhealthy_after),
    "health.healthy_after": (5, lambda r: _backend(r).outlier.config.healthy_after),
    "health.eject_after": (1, lambda r: _backend(r).outlier.request_failed(100.0)),
    "health.ejection_seconds": (1.0, lambda r: _backend(r).outlier.config.ejection_seconds),
    "health.max_ejection_seconds": (20.0, lambda r: _backend(r).outlier.config.max_ejection_seconds),
    "scrape.interval": (0.05, WithEngine(_scrapes_often)),
    "scrape.max_bytes": (1024, WithEngine(_reads_a_page_of_2_kb)),
    "scrape.timeout": (0.05, WithEngine(lambda r, e: _slow_engine_given_up(r, e, r.scraper.scrape_all))),
    "scrape.stale_after": (1.0, lambda r: _engine_metrics(r, EngineLoad(running=1), age=2.0)),
    "scrape.acceptance_max_age": (10.0, lambda r: _engine_metrics(r, EngineLoad(acceptance=0.7), age=20.0)),
    "conversations.enabled": (False, lambda r: r.plan.conversations.enabled),
    "conversations.session_header": ("X-Thread", lambda r: r.conversations.config.session_header),
    "conversations.block_chars": (64, lambda r: r.conversations.config.block_chars),
    "conversations.max_blocks": (8, lambda r: r.conversations.config.max_blocks),
    "conversations.max_entries": (10, lambda r: r.conversations.config.max_entries),
    "conversations.max_conversations": (10, lambda r: r.conversations.config.max_conversations),
    "conversations.max_age": (10.0, lambda r: r.conversations.config.max_age),
    "conversations.load_bound": (1, lambda r: r.plan.conversations.load_bound),
    "conversations.long_tokens": (10, lambda r: r.plan.conversations.long_tokens),
    "conversations.min_gain": (0.5, lambda r: r.plan.conversations.min_gain),
    "conversations.settle_seconds": (1.0, lambda r: r.conversations.config.settle_seconds),
    "conversations.prefill_token_seconds": (1e-3, lambda r: r.plan.conversations.prefill_token_seconds),
    "learn.min_samples": (2, lambda r: r.speeds.trust.min_samples),
    "learn.max_interval": (0.5, lambda r: r.speeds.trust.max_interval),
    "learn.half_life": (60.0, lambda r: r.speeds.trust.half_life),
    "learn.prior_weight": (2.0, lambda r: r.speeds.trust.prior_weight),
    "retries.attempts": (1, lambda r: r.plan.retries.attempts),
    "retries.deadline": (1.0, lambda r: r.plan.retries.deadline),
    "retries.cross_pool": (False, lambda r: r.plan.retries.cross_pool),
    "retries.budget": (0.5, lambda r: r.plan.retries.budget),
    "retries.min_concurrent": (1, lambda r: r.plan.retries.min_concurrent),
    "auth.client_keys_env": ("SPECROUTE_TEST_CLIENT_KEYS", lambda r: _raised(lambda: r.plan.auth.check_client(None))),
    "auth.override_keys_env": ("SPECROUTE_TEST_CLIENT_KEYS", lambda r: r.plan.auth.may_override(None, "x-route-pool")),
    "auth.untrusted_overrides": ("reject", lambda r: _raised(lambda: r.plan.auth.may_override(None, "x-route-pool"))),
    "auth.admin_key_env": ("SPECROUTE_TEST_ADMIN_KEY", lambda r: _raised(lambda: r.plan.auth.check_admin("admin"))),
    "shutdown.grace_seconds": (1.0, lambda r: r.grace_seconds),
    "limits.json_depth": (4, lambda r: r.plan.json_depth),
    "limits.response_head_bytes": (2048, lambda r: r.plan.head_limits.head_bytes),
    "limits.response_headers": (10, lambda r: r.plan.head_limits.headers),
    "limits.response_body_bytes": (100, lambda r: r.plan.response_body_bytes),
    "limits.sse_event_bytes": (2048, lambda r: r.plan.sse_event_bytes),
    "tls.ca_bundle": ("<ca>", lambda r: r.transport.tls.cert_store_stats()),
    # A client certificate is not readable back from a context: a new context shows it was taken.
    "tls.client_cert": ("<cert+key>", lambda r: id(r.transport.tls)),
    "tls.client_key": ("<key>", lambda r: id(r.transport.tls)),
    "tls.verify": (False, lambda r: r.transport.tls.verify_mode),
    "metrics.models": (["glm-batch"], lambda r: r.known_models()),
    "batch.max_file_bytes": (10, lambda r: _batches(r).config.max_file_bytes),
    "batch.max_storage_bytes": (10, lambda r: _batches(r).config.max_storage_bytes),
    "batch.max_lines": (10, lambda r: _batches(r).config.max_lines),
    "batch.max_concurrency": (2, lambda r: _batches(r).config.max_concurrency),
    "batch.reserve_slots": (2, lambda r: _batches(r).config.reserve_slots),
    "batch.poll_interval": (2.0, lambda r: _batches(r).config.poll_interval),
    "batch.ttft_rise": (3.0, lambda r: _batches(r).config.ttft_rise),
    "batch.lease_seconds": (2.0, lambda r: _batches(r).config.lease_seconds),
    "batch.max_attempts": (2, lambda r: _batches(r).config.max_attempts),
    "batch.retry_backoff": (2.0, lambda r: _batches(r).config.retry_backoff),
    "batch.upload_timeout": (2.0, lambda r: _batches(r).config.upload_timeout),
    "responses.affinity_seconds": (1.0, lambda r: _owner_after(r, 2.0)),
    "responses.affinity_max": (10, lambda r: _owner_after(r, 0.0, others=10)),
    "responses.locate_timeout": (0.25, lambda r: r.locator.timeout),
    "responses.locate_concurrency": (3, lambda r: r.locator.concurrency),
    "responses.locate_miss_seconds": (2.0, lambda r: r.locator.miss_seconds),
    "traffic.path": ("traffic.jsonl", lambda r: r.traffic.config.path),
    "traffic.max_bytes": (8192, lambda r: r.traffic.config.max_bytes),
    "traffic.buffer": (5, lambda r: r.traffic.config.buffer),
    "traffic.flush_seconds": (0.5, lambda r: r.traffic.config.flush_seconds),
    "pools.*.backends.*.discover": ("dns", lambda r: r.discovery.names),
    "discovery.interval": (1.0, lambda r: r.discovery.config.interval),
    "discovery.timeout": (1.0, lambda r: r.discovery.config.timeout),
    "discovery.max_addresses": (3, lambda r: r.discovery.config.max_addresses),
    "discovery.networks": (["10.0.0.0/8"], lambda r: r.discovery.config.networks),
    "discovery.nameservers": (["127.0.0.1:5353"], lambda r: type(r.discovery.resolver).__name__),
    "max_body_bytes": (10, lambda r: r.plan.max_body_bytes),
    "models_cache_seconds": (1.0, WithEngine(_model_lists_fetched)),
    "forward_client_authorization": (True, lambda r: r.plan.forward_authorization),
}

# Rows whose change shows only against another setting: that one is in the base as well.
BASE_FOR: dict[str, dict[str, dict[str, str]]] = {
    "auth.untrusted_overrides": {"auth": {"override_keys_env": "SPECROUTE_TEST_CLIENT_KEYS"}},
    "tls.client_key": {"tls": {"client_cert": "<cert+key>"}},
    "batch.store": {"batch": {"postgres_dsn_env": "SPECROUTE_TEST_DSN"}},
}

# setting -> the value a reload sets; the reload answer names each under `needs_restart`.
RESTART: dict[str, Any] = {
    "listen.host": "0.0.0.0",
    "listen.port": 9000,
    "listen.workers": 4,
    "listen.forwarded_allow_ips": ["*"],
    "timeouts.request_head": 1.0,
    "timeouts.keep_alive": 1.0,
    "timeouts.client_write": 1.0,
    "limits.request_head_bytes": 2048,
    "limits.request_headers": 10,
    "limits.max_connections": 10,
    "log.format": "json",
    "batch.enabled": False,
    "batch.store_dir": "elsewhere",
    "batch.store": "postgres",
    "batch.postgres_dsn_env": "SPECROUTE_TEST_DSN",
    "state.redis_url": "redis://127.0.0.1:1/0",
    "state.key_prefix": "other",
    "state.timeout": 0.1,
    "state.sync_interval": 0.5,
    "state.ttl": 20.0,
    "state.lease_slots": 2,
    "state.max_clients": 10,
    "state.max_connections": 4,
    "tracing.enabled": True,
    "tracing.endpoint": "http://127.0.0.1:4318/v1/traces",
    "tracing.sample_ratio": 0.5,
    "tracing.service_name": "router-a",
}


def test_every_setting_has_a_row() -> None:
    leaves = set(_leaves(Settings))
    assert not RELOADABLE.keys() & RESTART.keys()
    assert leaves == RELOADABLE.keys() | RESTART.keys()
    # The restart list is the runtime's own.
    assert {key for key in leaves if key.startswith(NEEDS_RESTART)} == RESTART.keys()


def _named(key: str) -> str:
    """A row's key with its `*` named: pool `fast`, backend `f1`, key group `g`."""
    key = key.replace("pools.*.backends.*", "pools.fast.backends.f1").replace("pools.*", "pools.fast")
    return key.replace("fairness.groups.*", "fairness.groups.g")


def _with(key: str, value: Any) -> dict[str, Any]:
    """BASE with one setting changed (`*` named by `_named`)."""
    data: dict[str, Any] = {**BASE, "pools": {k: dict(v) for k, v in BASE["pools"].items()}}
    data["pools"]["fast"]["backends"] = {"f1": dict(BASE["pools"]["fast"]["backends"]["f1"])}
    parts = _named(key).split(".")
    node = data
    for part in parts[:-1]:
        node[part] = dict(node.get(part, {}))
        node = node[part]
    node[parts[-1]] = value
    return data


def _engine_at(data: Any, url: str) -> Any:
    """`data` with the fake engine's address in place of ENGINE."""
    if isinstance(data, dict):
        return {key: _engine_at(value, url) for key, value in data.items()}
    return url if data == ENGINE else data


@pytest.fixture
def engine() -> Iterator[tuple[FakeEngine, str]]:
    fake = FakeEngine()
    with ServerThread(fake.app()) as server:
        yield fake, server.url


@pytest.fixture
def pem(tmp_path: Path) -> dict[str, str]:
    ca = trustme.CA()
    cert = ca.issue_cert("client.example")
    files = {"<ca>": tmp_path / "ca.pem", "<cert+key>": tmp_path / "both.pem", "<key>": tmp_path / "key.pem"}
    ca.cert_pem.write_to_path(str(files["<ca>"]))
    cert.private_key_and_cert_chain_pem.write_to_path(str(files["<cert+key>"]))
    cert.private_key_pem.write_to_path(str(files["<key>"]))
    return {name: str(path) for name, path in files.items()}


@pytest.mark.parametrize(
    "key",
    # e2e: a fake engine served on loopback, watched for up to 2 s
    [
        pytest.param(key, marks=pytest.mark.e2e) if isinstance(RELOADABLE[key][1], WithEngine) else key
        for key in sorted(RELOADABLE)
    ],
)
def test_a_reload_reaches_the_part_that_uses_the_setting(
    key: str, pem: dict[str, str], request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECROUTE_TEST_ENGINE_KEY", "engine-key")
    monkeypatch.setenv("SPECROUTE_TEST_CLIENT_KEYS", "client-key")
    monkeypatch.setenv("SPECROUTE_TEST_ADMIN_KEY", "admin-key")
    value, row = RELOADABLE[key]
    if isinstance(row, WithEngine):  # the row looks at what an engine saw: one is started
        fake, url = request.getfixturevalue("engine")
    else:  # it looks at the router alone, which never reaches the engine's address
        fake, url = FakeEngine(), "http://127.0.0.1:1"
    observe: Observe = (lambda r: row.observe(r, fake)) if isinstance(row, WithEngine) else row
    value = pem.get(value, value) if isinstance(value, str) else value
    base = {
        **BASE,
        **{section: {k: pem.get(v, v) for k, v in extra.items()} for section, extra in BASE_FOR.get(key, {}).items()},
    }
    changed = {**_with(key, value), **{s: {**base[s], **_with(key, value).get(s, {})} for s in BASE_FOR.get(key, {})}}
    router = _router(Settings.model_validate(_engine_at(base, url)))
    before = observe(router)
    answer = router.apply(Settings.model_validate(_engine_at(changed, url)))
    name = _named(key)
    assert [changed for changed in answer["changed"] if changed == name or changed.startswith(name + ".")]
    assert answer["needs_restart"] == []
    assert observe(router) != before


@pytest.mark.parametrize("key", sorted(RESTART))
def test_a_reload_names_the_settings_that_need_a_restart(key: str) -> None:
    extra = BASE_FOR.get(key, {})
    base = {**BASE, **extra}
    changed = {**_with(key, RESTART[key]), **{s: {**base[s], **_with(key, RESTART[key]).get(s, {})} for s in extra}}
    router = _router(Settings.model_validate(_engine_at(base, "http://127.0.0.1:1")))
    answer = router.apply(Settings.model_validate(_engine_at(changed, "http://127.0.0.1:1")))
    assert answer["needs_restart"] == [key]


@pytest.mark.e2e
def test_a_request_under_way_keeps_the_settings_it_arrived_with(
    tmp_path: Path, make_cluster: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reload that turns `retries.cross_pool` off while a request's first attempt waits for the
    engine's 503: that request still fails over to the other pool, as the settings it arrived
    with allow; the next one does not. A router that read the settings anew at each step would
    let the request retry, then find no pool to retry on (503 pool_unavailable)."""
    import concurrent.futures
    import threading

    import httpx
    import yaml

    config = tmp_path / "router.yaml"
    monkeypatch.setenv("SPECROUTE_TEST_ADMIN_KEY", "admin-secret")
    settings = {"auth": {"admin_key_env": "SPECROUTE_TEST_ADMIN_KEY"}}
    with make_cluster(config_file=config, **settings) as cluster, concurrent.futures.ThreadPoolExecutor(1) as pool:
        chat = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        url = cluster.base_url + "/chat/completions"
        cluster.fast.fail_status = 503
        cluster.fast.gate = gate = threading.Event()  # the engine answers once the reload is done
        under_way = pool.submit(httpx.post, url, json=chat, timeout=30)
        wait_until(lambda: len(cluster.fast.requests) == 1, message="the first request at the engine")
        data = yaml.safe_load(config.read_text())
        data["retries"] = {"cross_pool": False}
        config.write_text(yaml.safe_dump(data))
        admin = httpx.post(
            cluster.router.url + "/admin/reload", headers={"authorization": "Bearer admin-secret"}, timeout=10
        )
        assert admin.json()["changed"] == ["retries.cross_pool"]
        gate.set()
        answer = under_way.result()
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-route-reason"] == "failover:fast"
        after = httpx.post(url, json=chat, timeout=30)
        assert after.status_code == 503 and after.json()["error"]["message"] == "overloaded"  # the engine's own
        assert len(cluster.team.requests) == 1


def test_a_reload_reaches_a_running_batch_runner(tmp_path: Path) -> None:
    """The runner reads the section the service hands on from `apply`: a reload reaches one
    already running (max_concurrency, reserve_slots, poll_interval, ttft_rise, lease_seconds,
    max_attempts, retry_backoff are read there), not only the service."""
    base = {**BASE, "batch": {"store_dir": str(tmp_path)}}
    changed = {**base, "batch": {"store_dir": str(tmp_path), "max_concurrency": 2, "lease_seconds": 2.0}}
    router = _router(Settings.model_validate(_engine_at(base, "http://127.0.0.1:1")))
    service = _batches(router)

    async def reload_while_running() -> tuple[int, float]:
        await service.start()
        try:
            router.apply(Settings.model_validate(_engine_at(changed, "http://127.0.0.1:1")))
            return service.runner.config.max_concurrency, service.runner.config.lease_seconds
        finally:
            await service.stop()

    assert asyncio.run(reload_while_running()) == (2, 2.0)


def test_the_router_keeps_no_section_of_its_own() -> None:
    """Every section goes to the part that uses it, through `apply`: nothing reads one off the
    Router (as `router.batch` would be, read by the Batch API's service and runner)."""
    router = _router(Settings.model_validate(_engine_at(BASE, "http://127.0.0.1:1")))
    held = {name for name, value in vars(router).items() if isinstance(value, BaseModel)}
    assert held == {"_settings"}  # the settings last applied, for the restart-only sections
