"""Two router replicas (`specroute serve` processes) behind a real nginx, round robin, with and
without one real Redis between them; engines that count what they serve at once.

A batch job (six concurrent requests from one address, one `user`, in waves) must be classified
batch on both replicas and an interactive user beside it stay interactive; the engines' slots
must not be over-committed by the two replicas together. Without Redis, the same run shows what
a replica alone sees: the job's requests split between them, each below the threshold.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from tests.fake_engine import FakeEngine
from tests.nginx import Nginx
from tests.redis import RedisServer
from tests.servers import ServerThread, serve
from tests.wait import wait_until

pytestmark = pytest.mark.e2e

SLOTS = 3  # per backend, for the replicas together
JOB = 6  # the batch job's requests at once
WAVES = 4


@dataclass(frozen=True)
class Cluster:
    base: str  # nginx's URL
    replicas: list[str]
    fast: FakeEngine  # the speculative pool's engine
    team: FakeEngine

    def within_slots(self) -> bool:
        """Whether each engine served at most the slots its backend has, counted once for both."""
        return self.fast.most_open <= SLOTS and self.team.most_open <= SLOTS


@contextmanager
def cluster(tmp: Path, redis_url: str | None) -> Iterator[Cluster]:
    """Two engines, two replicas (each `specroute serve` with the same settings), nginx."""
    fast = FakeEngine(model="m", first_token_delay=0.05, token_delay=0.02)
    team = FakeEngine(model="m", first_token_delay=0.05, token_delay=0.02)
    with ExitStack() as stack:
        engines = [stack.enter_context(ServerThread(engine.app())) for engine in (fast, team)]

        def pool(name: str, url: str, *, speculative: bool) -> dict[str, Any]:
            return {"speculative": speculative, "backends": {name: {"url": url, "max_concurrency": SLOTS}}}

        settings: dict[str, Any] = {
            "pools": {
                "fast": pool("fast-1", engines[0].url, speculative=True),
                "team": pool("team-1", engines[1].url, speculative=False),
            },
            "health": {"interval": 1},
            # Threads on a busy 2-core machine, through nginx, spread a burst's arrivals past the
            # default 20 ms hold, for one router as for two: held long enough to show itself.
            "classify": {"burst_hold_seconds": 0.25},
        }
        if redis_url is not None:
            # Generous for a busy shared machine: what is measured here is the sharing, not its speed.
            settings["state"] = {"redis_url": redis_url, "timeout": 0.2, "sync_interval": 0.1, "ttl": 2}
        urls = []
        for name in ("a", "b"):
            (tmp / name).mkdir()
            config = tmp / name / "router.yaml"
            config.write_text(yaml.safe_dump(settings))
            _, url = stack.enter_context(serve(config, own_session=True))
            urls.append(url)
        lb = stack.enter_context(Nginx([url.removeprefix("http://") for url in urls]))
        if redis_url is not None:
            for url in urls:
                wait_until(partial(sharing, url), message=f"{url} shares its state")
        yield Cluster(lb.url, urls, fast, team)


def sharing(url: str, expected: bool = True) -> bool:
    state = httpx.get(url + "/readyz", timeout=5).json()["shared_state"]
    return state["sharing"] is expected


def decisions(url: str) -> Counter[str]:
    """The replica's routing decisions so far, by job class."""
    counts: Counter[str] = Counter()
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("specroute_route_decisions_total{"):
            job = line.split('job_class="', 1)[1].split('"', 1)[0]
            counts[job] += int(float(line.rsplit(" ", 1)[1]))
    return counts


def run(base: str, *, during: Callable[[int], None] = lambda wave: None) -> tuple[list[str], list[str]]:
    """The batch job in waves of JOB concurrent requests and an interactive user beside it, one
    request at a time; returns each one's job class, as the router answered it (X-Job-Type)."""
    local = threading.local()
    clients: list[openai.OpenAI] = []

    def client() -> openai.OpenAI:
        if not hasattr(local, "client"):
            local.client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
            clients.append(local.client)
        return local.client  # type: ignore[no-any-return]

    def ask(user: str) -> str:
        raw = client().chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": "Sort these rows."}], max_tokens=12, stream=True, user=user
        )
        assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
        return raw.headers["x-job-type"]

    done = threading.Event()
    interactive: list[str] = []

    def user() -> None:
        while not done.is_set():
            interactive.append(ask("alice"))

    batch: list[str] = []
    try:
        with ThreadPoolExecutor(JOB + 1) as pool:
            beside = pool.submit(user)
            try:
                for wave in range(WAVES):
                    during(wave)
                    batch += pool.map(ask, ["etl"] * JOB)
            finally:
                done.set()
                beside.result()
    finally:
        for each in clients:
            each.close()
    return batch, interactive


def test_a_batch_job_split_by_nginx_is_batch_on_both_replicas_sharing_redis(tmp_path: Path) -> None:
    with RedisServer() as redis, cluster(tmp_path, redis.url) as replicas:
        batch, interactive = run(replicas.base)
        assert batch == ["batch"] * JOB * WAVES, " ".join(b[0] for b in batch)
        assert interactive and set(interactive) == {"interactive"}
        for url in replicas.replicas:
            assert decisions(url)["batch"] >= JOB  # each replica classified its share batch
        # The two replicas together kept each engine within its slots, and the job filled its pool's.
        assert replicas.within_slots(), (replicas.fast.most_open, replicas.team.most_open)
        assert replicas.team.most_open == SLOTS


def test_alone_the_same_job_is_split_below_the_threshold(tmp_path: Path) -> None:
    """The comparison (docs/replicas.md): without Redis, each replica sees three of the six."""
    with cluster(tmp_path, None) as replicas:
        batch, interactive = run(replicas.base)
    assert batch.count("batch") == 0, batch
    assert not replicas.within_slots()  # the job landed on the speculative pool, past its slots
    assert set(interactive) == {"interactive"}


def test_redis_killed_and_restarted_mid_run_fails_no_request(tmp_path: Path) -> None:
    with RedisServer() as redis, cluster(tmp_path, redis.url) as replicas:

        def chaos(wave: int) -> None:
            if wave == 1:
                redis.kill()
                for url in replicas.replicas:
                    wait_until(partial(sharing, url, False), message=f"{url} falls back to its own view")
            elif wave == 3:
                redis.start()
                for url in replicas.replicas:
                    wait_until(partial(sharing, url), message=f"{url} rejoins")

        batch, interactive = run(replicas.base, during=chaos)  # a request that failed would raise
        assert len(batch) == JOB * WAVES and interactive
        for url in replicas.replicas:
            metrics = httpx.get(url + "/metrics", timeout=5).text
            assert "specroute_shared_state_fallbacks_total 1.0" in metrics
            assert "specroute_shared_state_up 1.0" in metrics
    for name in ("a", "b"):
        log = (tmp_path / name / "router.log").read_text()
        assert log.count("deciding alone from now on") == 1, log
        assert log.count("joined the other replicas") == 2, log
