"""Two real vLLM servers and the router in front of them, started once for the session.

`fast` is the speculative pool (ngram prompt lookup, core 0), `team` the standard one (core 1),
both serving the tiny model of scripts/real-engines with an 8 MB KV cache (4,096 tokens), so
that KV usage, waiting and preemption move under a handful of long requests. The router runs
in this process under uvicorn, so its registry can be read directly.

If the engines are not installed the tests fail, naming the command: CI runs
`scripts/real-engines install` first, and a suite that skips itself would hide a broken install.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletion
from prometheus_client import CollectorRegistry

from router.app import create_app
from router.config import Settings
from tests.real.engines import MODEL, Engine, NotInstalled, check_installed, wait_for
from tests.servers import ServerThread

ADMIN_ENV, ADMIN_KEY = "SPECROUTE_REAL_ADMIN_KEY", "real-admin"


def router_settings(fast_url: str, team_url: str) -> Settings:
    data: dict[str, Any] = dict(
        pools={
            # Room in the router for more than the 8 MB KV cache holds: the engine's own
            # readings (waiting, KV usage) are what must stop interactive work, not the slots.
            "fast": {"speculative": True, "backends": {"fast-1": {"url": fast_url, "max_concurrency": 32}}},
            "team": {"speculative": False, "backends": {"team-1": {"url": team_url, "max_concurrency": 32}}},
        },
        # Crossover mode with a crossover nobody reaches: every spill these tests see comes from
        # what the engines report, not from learned speeds that vary with this machine's load.
        routing={"mode": "crossover", "crossover": {"prose": 64, "code": 64}},
        # The whole suite is one client on one address: keep the batch heuristic out of the way.
        classify={"batch_inflight_threshold": 64, "client_memory_seconds": 0},
        # Readings stay usable for 15 s: the router shares the cores with two engines whose threads
        # spin, and a starved router's scrapes can all time out for 10-15 s (seen in a run of the
        # spill test: both engines stale, so no pool had room to spill to). A scrape still has
        # 2 s, and an engine that is down goes stale well within its 60-90 s restart.
        scrape={"interval": 0.5, "timeout": 2.0, "stale_after": 15.0},
        health={
            "interval": 1.0,
            "timeout": 2.0,
            "unhealthy_after": 2,
            "healthy_after": 2,
            "eject_after": 3,
            # Long enough for a test to see the ejection before the health checks take over.
            "ejection_seconds": 10.0,
        },
        auth={"admin_key_env": ADMIN_ENV},
    )
    return Settings(**data)


@dataclass
class RealCluster:
    fast: Engine
    team: Engine
    router: ServerThread
    registry: CollectorRegistry

    @property
    def base_url(self) -> str:
        return self.router.url + "/v1"

    def client(self, **options: Any) -> OpenAI:
        # No retries in the SDK: what a test sees is what the router answered.
        return OpenAI(base_url=self.base_url, api_key="none", max_retries=0, timeout=120, **options)

    def direct(self, engine: Engine) -> OpenAI:
        return OpenAI(base_url=engine.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = httpx.get(self.router.url + "/router/status", timeout=5).json()
        return status

    def backend(self, pool: str) -> dict[str, Any]:
        view: dict[str, Any] = self.status()["pools"][pool]["backends"][f"{pool}-1"]
        return view

    def admin(self, action: str, body: dict[str, str]) -> httpx.Response:
        headers = {"authorization": f"Bearer {ADMIN_KEY}"}
        return httpx.post(f"{self.router.url}/admin/{action}", json=body, headers=headers, timeout=10)

    def chat(
        self,
        *,
        user: str,
        max_tokens: int = 8,
        pool: str | None = None,
        job: str | None = None,
        content: str = "Tell me about tides.",
        client: OpenAI | None = None,
    ) -> tuple[str, str, ChatCompletion]:
        """One chat request through the router: the pool that served it, the reason, the answer.
        `client`: one made beforehand (making one takes a while on a busy machine)."""
        headers = {key: value for key, value in (("X-Route-Pool", pool), ("X-Job-Type", job)) if value}
        raw = (client or self.client()).chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": content}],
            max_tokens=max_tokens,
            user=user,
            extra_headers=headers,
            extra_body={"ignore_eos": True},  # exactly max_tokens, whatever the random model says
        )
        return raw.headers["x-route-pool"], raw.headers["x-route-reason"], raw.parse()

    def router_metric(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, labels)

    def idle(self) -> bool:
        """Both backends take work, and neither the router nor an engine has a request running."""
        status = self.status()
        for pool in ("fast", "team"):
            view = status["pools"][pool]["backends"][f"{pool}-1"]
            if not view["healthy"] or view["draining"] or view["ejected_seconds_left"] > 0 or view["in_flight"]:
                return False
        return all(engine.metric("vllm:num_requests_running") == 0 for engine in (self.fast, self.team))


@pytest.fixture(scope="session")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Engine]]:
    try:
        check_installed()
    except NotInstalled as exc:
        pytest.fail(f"the real-engine suite cannot run: {exc}", pytrace=False)
    logs = tmp_path_factory.mktemp("real-engines")
    fast, team = Engine("spec", core=0, log_dir=logs), Engine("standard", core=1, log_dir=logs)
    with ExitStack() as stack:
        for engine in (fast, team):
            engine.start()
            stack.callback(engine.stop)
        fast.wait_healthy()
        team.wait_healthy()
        yield fast, team


@contextmanager
def router_in_front(fast: Engine, team: Engine) -> Iterator[RealCluster]:
    """A router of its own, started now, in front of the engines."""
    registry = CollectorRegistry()
    app = create_app(router_settings(fast.url, team.url), registry=registry)
    with ServerThread(app, fast=True) as router:
        yield RealCluster(fast, team, router, registry)


@pytest.fixture(scope="session")
def real(engines: tuple[Engine, Engine]) -> Iterator[RealCluster]:
    os.environ[ADMIN_ENV] = ADMIN_KEY
    try:
        with router_in_front(*engines) as cluster:
            yield cluster
    finally:
        del os.environ[ADMIN_ENV]


@pytest.fixture
def cluster(real: RealCluster) -> RealCluster:
    """The session's cluster once it is idle and whole again after the test before."""
    wait_for(real.idle, timeout=120, what="both backends healthy, undrained and idle")
    return real
