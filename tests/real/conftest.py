"""Two real vLLM servers and the router in front of them, started once for the session.

`fast` is the speculative pool (ngram prompt lookup, core 0), `team` the standard one (core 1),
both serving the tiny model of scripts/real-engines with an 8 MB KV cache (4,096 tokens), so
that KV usage, waiting and preemption move under a handful of long requests.

The router runs as in production, `specroute serve` in a process of its own, in a session of
its own like each engine (tests/real/engines.py: so each gets a fair share of the CPU): the tests
read its `/metrics`, `/router/status` and its log (one JSON object a line). In this process it
shared the interpreter's lock with the tests' own client threads, and on two busy cores its event
loop was held up for 3-12 s at a time: scrapes and health checks timed out, a connect to an idle
engine timed out after 5 s, and pooled connections outlived the engine's keep-alive.

If the engines are not installed the tests fail, naming the command: CI runs
`scripts/real-engines install` first, and a suite that skips itself would hide a broken install.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from openai import OpenAI
from openai.types.chat import ChatCompletion
from prometheus_client.parser import text_string_to_metric_families

from tests.real.engines import MODEL, Engine, NotInstalled, check_installed, wait_for
from tests.servers import serve

ADMIN_ENV, ADMIN_KEY = "SPECROUTE_REAL_ADMIN_KEY", "real-admin"


def router_settings(fast_url: str, team_url: str) -> dict[str, Any]:
    return dict(
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
        # Readings stay usable for 15 s: the engines' threads spin on both cores, and a scrape
        # that gets no turn in time is not an engine gone. A scrape still has 2 s, and an engine
        # that is down goes stale well within its 60-90 s restart.
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
        # The real engines hold 2,048 tokens a request: a conversation is long from 128 (of the
        # router's estimate, four characters a token) rather than 2,048.
        conversations={"long_tokens": 128},
        auth={"admin_key_env": ADMIN_ENV},
        log={"format": "json"},
    )


@dataclass
class RealCluster:
    fast: Engine
    team: Engine
    url: str  # the router's
    log: Path  # the router's log: one JSON object a line
    _clients: list[OpenAI] = field(default_factory=list)
    _local: threading.local = field(default_factory=threading.local)

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def new_client(self) -> OpenAI:
        """A client of its own, for the caller to close. No retries in the SDK: what a test sees
        is what the router answered."""
        return OpenAI(base_url=self.base_url, api_key="none", max_retries=0, timeout=120)

    def client(self) -> OpenAI:
        """This thread's client, made once and closed with the cluster: making one takes tens of
        milliseconds of CPU, which a test sending a request every 0.2 s should not spend on each."""
        client: OpenAI | None = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = self.new_client()
            self._clients.append(client)
        return client

    def close(self) -> None:
        for client in self._clients:
            client.close()

    def direct(self, engine: Engine) -> OpenAI:
        client = OpenAI(base_url=engine.url + "/v1", api_key="none", max_retries=0, timeout=120)
        self._clients.append(client)
        return client

    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = httpx.get(self.url + "/router/status", timeout=5).json()
        return status

    def backend(self, pool: str) -> dict[str, Any]:
        view: dict[str, Any] = self.status()["pools"][pool]["backends"][f"{pool}-1"]
        return view

    def admin(self, action: str, body: dict[str, str]) -> httpx.Response:
        headers = {"authorization": f"Bearer {ADMIN_KEY}"}
        return httpx.post(f"{self.url}/admin/{action}", json=body, headers=headers, timeout=10)

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
        `client`: another than this thread's."""
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
        """The router's own `/metrics`: the sample named `name` with exactly these labels, if any."""
        text = httpx.get(self.url + "/metrics", timeout=5).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and sample.labels == labels:
                    return float(sample.value)
        return None

    def log_lines(self, since: int = 0) -> list[dict[str, Any]]:
        """The router's log lines from line `since` on (a line not yet whole is left for later)."""
        text = self.log.read_text()
        return [json.loads(line) for line in text.splitlines(keepends=True)[since:] if line.endswith("\n")]

    def backend_changes(self, backend: str, since: int = 0) -> list[tuple[int, str]]:
        """The router's state lines (logger specroute.backends) about one backend, in order:
        (level, message)."""
        prefix = f"backend {backend} ("
        return [
            (logging.getLevelNamesMapping()[line["level"]], line["message"])
            for line in self.log_lines(since)
            if line["logger"] == "specroute.backends" and line["message"].startswith(prefix)
        ]

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
    # The standard engine schedules by priority (test_real_priority.py); a request without one
    # is 0, so for every other test it serves in arrival order as by default.
    fast = Engine("spec", core=0, log_dir=logs)
    team = Engine("standard", core=1, log_dir=logs, scheduling="priority")
    with ExitStack() as stack:
        for engine in (fast, team):
            engine.start()
            stack.callback(engine.stop)
        fast.wait_healthy()
        team.wait_healthy()
        yield fast, team


@pytest.fixture(scope="session")
def routers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where each router of the session keeps its configuration and log."""
    return tmp_path_factory.mktemp("routers")


@contextmanager
def router_in_front(
    fast: Engine, team: Engine, directory: Path, changes: dict[str, Any] | None = None
) -> Iterator[RealCluster]:
    """A router of its own, started now in its own process (`specroute serve`), in front of the
    engines; its configuration (`router_settings`, with `changes` to its sections) and log in a
    new folder under `directory`."""
    home = directory / f"router-{len(list(directory.iterdir()))}"
    home.mkdir()
    config = home / "router.yaml"
    settings = router_settings(fast.url, team.url)
    for section, values in (changes or {}).items():
        settings[section] = values
    config.write_text(yaml.safe_dump(settings))
    with serve(config, env={ADMIN_ENV: ADMIN_KEY}, own_session=True) as (_, url):
        cluster = RealCluster(fast, team, url, home / "router.log")
        try:
            yield cluster
        finally:
            cluster.close()


@pytest.fixture(scope="session")
def real(engines: tuple[Engine, Engine], routers: Path) -> Iterator[RealCluster]:
    with router_in_front(*engines, routers) as cluster:
        yield cluster


@pytest.fixture
def cluster(real: RealCluster) -> RealCluster:
    """The session's cluster once it is idle and whole again after the test before."""
    wait_for(real.idle, timeout=120, what="both backends healthy, undrained and idle")
    return real
