from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette

from router.app import create_app
from router.clock import Clock
from router.config import Settings, load_settings
from tests import servers
from tests.fake_engine import FakeEngine
from tests.servers import ServerThread, stop_together
from tests.wait import wait_until


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test of the fast unit set (`-m 'not e2e and not real'`) may not start a server: the
    set stays what it says, and a server started there fails the test, asking for the mark."""
    marked = any(item.get_closest_marker(name) for name in ("e2e", "real"))
    servers.unmarked_test = None if marked else item.nodeid


def pytest_runtest_teardown(item: pytest.Item) -> None:
    servers.unmarked_test = None


class Cluster:
    """Two fake engines (pool `fast`, speculative; pool `team`, standard) and a router."""

    def __init__(
        self, fast: FakeEngine, team: FakeEngine, router: ServerThread, app: Starlette, registry: CollectorRegistry
    ) -> None:
        self.fast = fast
        self.more_fast: list[FakeEngine] = []  # fast-2, fast-3, ...
        self.app = app
        self.team = team
        self.router = router
        self.registry = registry
        self.config: dict[str, Any] = {}  # the settings it started with, as plain data
        self._clients: list[openai.OpenAI] = []

    def client(self, api_key: str = "none", **options: Any) -> openai.OpenAI:
        """An SDK client of this router, closed with the cluster. A client left open holds its
        sockets in a reference cycle, and the garbage collector may close them in any later test:
        under `filterwarnings = error` their ResourceWarning fails that test."""
        client = openai.OpenAI(base_url=self.base_url, api_key=api_key, **{"max_retries": 0, **options})
        self._clients.append(client)
        return client

    def close_clients(self) -> None:
        for client in self._clients:
            client.close()

    @property
    def base_url(self) -> str:
        return self.router.url + "/v1"

    def metric(self, name: str, **labels: str) -> float:
        value = self.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    def settled_metric(self, name: str, expected: float, **labels: str) -> float:
        """The metric once it reads `expected`, or its value when the wait is over.

        The router records a request just after its last byte went out, in another thread,
        so a test that has read the whole response may be a moment early.
        """
        with contextlib.suppress(AssertionError):
            wait_until(lambda: self.metric(name, **labels) == expected, message=f"{name} == {expected}")
        return self.metric(name, **labels)


def settings_for(fast_url: str, team_url: str, **overrides: Any) -> Settings:
    return Settings(**settings_data(fast_url, team_url, **overrides))


def settings_data(fast_url: str, team_url: str, **overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "pools": {
            "fast": {"speculative": True, "backends": {"fast-1": {"url": fast_url, "max_concurrency": 8}}},
            "team": {"speculative": False, "backends": {"team-1": {"url": team_url, "max_concurrency": 8}}},
        }
    }
    return _merge(data, overrides)


def _merge(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


@contextmanager
def running_cluster(
    *,
    fast_backends: int = 1,
    config_file: Path | None = None,
    clock: Callable[[], float] = time.time,
    live_clock: Clock | None = None,
    **overrides: Any,
) -> Iterator[Cluster]:
    """Fake engines and a router; `fast_backends` > 1 adds engines `fast-2`, ... to pool `fast`.
    With `config_file`, the settings are written there as YAML and a reload reads that file.
    `clock` is the router's wall clock for the Batch API (expiry tests move it); `live_clock`
    the monotonic clock of its live state (ejection, staleness: tests move a ManualClock)."""
    with ExitStack() as stack:
        fast, team = FakeEngine(), FakeEngine()
        fast_server = stack.enter_context(ServerThread(fast.app()))
        team_server = stack.enter_context(ServerThread(team.app()))
        more = [FakeEngine() for _ in range(fast_backends - 1)]
        more_servers = [stack.enter_context(ServerThread(engine.app())) for engine in more]
        extra = {f"fast-{i + 2}": {"url": server.url, "max_concurrency": 8} for i, server in enumerate(more_servers)}
        # On exit the router stops first (it would see its engines gone and say so), then the
        # engines all at once.
        stack.callback(stop_together, [fast_server, team_server, *more_servers])
        registry = CollectorRegistry()
        store = stack.enter_context(tempfile.TemporaryDirectory(prefix="specroute-batches-"))
        defaults = {"pools": {"fast": {"backends": extra}}, "batch": {"store_dir": store}}
        data = settings_data(fast_server.url, team_server.url, **_merge(defaults, overrides))
        load = None
        if config_file is not None:
            config_file.write_text(yaml.safe_dump(data))
            load = partial(load_settings, config_file)
        app = create_app(Settings(**data), registry=registry, load=load, clock=clock, live_clock=live_clock)
        router = stack.enter_context(ServerThread(app, fast=True))
        cluster = Cluster(fast, team, router, app, registry)
        stack.callback(cluster.close_clients)
        cluster.more_fast = more
        cluster.config = data
        yield cluster


SDK = Callable[..., openai.OpenAI]


@pytest.fixture
def sdk() -> Iterator[SDK]:
    """SDK clients of any server (`sdk(url, api_key=..., ...)`, url ending before /v1), closed
    when the test ends: see Cluster.client."""
    made: list[openai.OpenAI] = []

    def client(url: str, api_key: str = "none", **options: Any) -> openai.OpenAI:
        made.append(openai.OpenAI(base_url=url + "/v1", api_key=api_key, **{"max_retries": 0, **options}))
        return made[-1]

    yield client
    for each in made:
        each.close()


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    with running_cluster() as running:
        yield running


@pytest.fixture
def make_cluster() -> Callable[..., AbstractContextManager[Cluster]]:
    return running_cluster
