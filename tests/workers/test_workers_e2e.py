"""`specroute serve --workers 2` as its operator runs it: one port, two worker processes, the
official openai client, fake engines that count what they serve at once.

Each request goes on a connection of its own, so the kernel spreads them over both workers; the
tests reach each worker alone on its private socket (found in the supervisor's run directory,
under the test's TMPDIR) to see what each one did.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import httpx2
import openai
import pytest
import yaml

from tests.conftest import settings_data
from tests.fake_engine import FakeEngine
from tests.servers import ServerThread, free_port, serve
from tests.wait import wait_until

pytestmark = pytest.mark.e2e

SLOTS = 3  # per backend, for the workers together
JOB = 6  # the batch job's requests at once
ADMIN_KEY = "admin-secret"


@dataclass
class Workers:
    url: str
    process: subprocess.Popen[str]
    rundir: Path
    fast: FakeEngine
    team: FakeEngine
    config: Path
    log: Path

    def worker(self, index: int) -> httpx.Client:
        """Worker `index` alone, on its private socket."""
        transport = httpx.HTTPTransport(uds=str(self.rundir / f"worker-{index}.sock"))
        return httpx.Client(transport=transport, base_url="http://worker", timeout=10)

    def each(self, path: str) -> list[Any]:
        answers = []
        for index in range(2):
            with self.worker(index) as client:
                answers.append(client.get(path).json())
        return answers

    def decisions(self) -> list[Counter[str]]:
        """Each worker's routing decisions so far, by job class."""
        counts = []
        for index in range(2):
            with self.worker(index) as client:
                counts.append(decisions(client.get("/metrics").text))
        return counts

    def wait_sharing(self) -> None:
        def listening(index: int) -> bool:
            with socket.socket(socket.AF_UNIX) as probe:
                return probe.connect_ex(str(self.rundir / f"worker-{index}.sock")) == 0

        def sharing() -> bool:
            if not all(map(listening, range(2))):
                return False  # a worker still starting
            return all(view["shared_state"]["sharing"] for view in self.each("/readyz"))

        wait_until(sharing, timeout=60, message="both workers up and sharing")

    def pids(self) -> set[int]:
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text().split()
        return {int(pid) for pid in children}


@contextmanager
def workers(tmp: Path, *, port: int | None = None, **overrides: Any) -> Iterator[Workers]:
    """`port`: the one the workers listen on (else a free one)."""
    fast = FakeEngine(first_token_delay=0.05, token_delay=0.02)
    team = FakeEngine(first_token_delay=0.05, token_delay=0.02)
    with ExitStack() as stack:
        engines = [stack.enter_context(ServerThread(engine.app())) for engine in (fast, team)]
        data = settings_data(engines[0].url, engines[1].url, **overrides)
        for pool in data["pools"].values():
            for backend in pool["backends"].values():
                backend["max_concurrency"] = SLOTS
        data.setdefault("classify", {}).setdefault("burst_hold_seconds", 0.25)
        data["auth"] = {"admin_key_env": "TEST_ADMIN_KEY"}
        config = tmp / "router.yaml"
        config.write_text(yaml.safe_dump(data))
        (tmp / "run").mkdir()
        env = {"TMPDIR": str(tmp / "run"), "TEST_ADMIN_KEY": ADMIN_KEY}
        process, url = stack.enter_context(serve(config, env=env, args=["--workers", "2"], own_session=True, port=port))
        [rundir] = (tmp / "run").glob("specroute-workers-*")
        found = Workers(url, process, rundir, fast, team, config, tmp / "router.log")
        found.wait_sharing()
        yield found


def ask(url: str, user: str = "alice", *, key: str = "none", tokens: int = 12) -> str:
    """One streamed request on a connection of its own; the job class the router answered."""
    with _client(url, key) as client:
        return _ask(client, user, tokens)


def wave(url: str, user: str, count: int = JOB, *, tokens: int = 12, uds: Path | None = None) -> list[str]:
    """`count` requests of `user` sent together, each on a connection of its own (to one worker
    if `uds`, its private socket); their job classes. The SDK's clients are made first: one takes
    about 40 ms of CPU (its TLS context), so made inside the wave six spread it over a quarter of
    a second on an idle machine and past the burst hold on a busy one, where the first requests
    went out alone and passed for interactive."""
    clients = [_client(url, uds=uds) for _ in range(count)]
    together = threading.Barrier(count)

    def send(client: openai.OpenAI) -> str:
        with client:
            together.wait(timeout=60)
            return _ask(client, user, tokens)

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(send, clients))


def _client(url: str, key: str = "none", *, uds: Path | None = None) -> openai.OpenAI:
    if uds is None:
        return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)
    http = openai.DefaultHttpxClient(transport=httpx2.HTTPTransport(uds=str(uds)), timeout=60)  # the SDK's httpx
    return openai.OpenAI(base_url="http://worker/v1", api_key=key, max_retries=0, http_client=http)


def _ask(client: openai.OpenAI, user: str, tokens: int) -> str:
    raw = client.chat.completions.with_raw_response.create(
        model="test-model",
        messages=[{"role": "user", "content": "Sort these rows."}],
        max_tokens=tokens,
        stream=True,
        user=user,
    )
    assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    return raw.headers["x-job-type"]


def decisions(metrics: str) -> Counter[str]:
    counts: Counter[str] = Counter()
    for line in metrics.splitlines():
        if line.startswith("specroute_route_decisions_total{"):
            counts[line.split('job_class="', 1)[1].split('"', 1)[0]] += int(float(line.rsplit(" ", 1)[1]))
    return counts


def test_a_batch_job_on_both_workers_is_batch_within_the_slots_and_one_scrape_counts_all(tmp_path: Path) -> None:
    # The first wave is one burst only if it all arrives within the burst hold, a wall-clock
    # window: at load 13 on two cores a quarter of a second was too short for six requests to
    # arrive (three passed for interactive). The hold ends as soon as more than four are in
    # flight across the workers, so a longer one costs only the waves that split 3 + 3.
    with workers(tmp_path, classify={"burst_hold_seconds": 2.0}) as cluster:
        batch: list[str] = []
        for _ in range(4):
            batch += wave(cluster.url, "etl")
        assert batch == ["batch"] * JOB * 4, batch
        per_worker = cluster.decisions()
        assert all(seen["batch"] >= 1 for seen in per_worker), per_worker  # the job landed on both
        # Both together kept each engine within its slots, and the job filled its pool's.
        assert cluster.team.most_open == SLOTS and cluster.fast.most_open <= SLOTS
        # One scrape of the port counts every worker's decisions.
        total = decisions(httpx.get(cluster.url + "/metrics", timeout=10).text)
        assert total["batch"] == sum(seen["batch"] for seen in per_worker) == JOB * 4
        status = httpx.get(cluster.url + "/router/status", timeout=10).json()
        assert status["workers"]["count"] == 2 and status["workers"]["answered"] == 2


def test_alone_an_interactive_user_stays_interactive_on_both_workers(tmp_path: Path) -> None:
    with workers(tmp_path) as cluster:
        # Connections land on either worker at random: until both have served (2^-31 to fail).
        for _ in range(32):
            assert ask(cluster.url, "bob") == "interactive"
            served = cluster.decisions()
            if all(seen["interactive"] for seen in served):
                break
        assert all(seen["interactive"] for seen in served), served


def test_a_backend_at_the_workers_own_port_takes_no_work(tmp_path: Path) -> None:
    """A backend at the router's own address (router.backends.health): each worker's health check
    may reach either worker, so both refuse the `Via` of the router as a whole, not their own."""
    port = free_port()
    itself = {"url": f"http://127.0.0.1:{port}", "max_concurrency": SLOTS}
    with workers(tmp_path, port=port, pools={"fast": {"backends": {"itself": itself}}}) as cluster:
        # Each worker checks the backend over a connection the kernel gives to one of the two:
        # until both have found it is the router (both log it), on any connection.
        wait_until(
            lambda: cluster.log.read_text().count("backend itself (pool fast) is this router itself") >= 2,
            timeout=60,
            message="both workers' health checks found the backend is the router",
        )
        assert all(not view["backends"]["itself"] for view in cluster.each("/readyz"))
        routed = [ask(cluster.url, f"user-{i}") for i in range(8)]
        assert routed == ["interactive"] * 8
        assert len(cluster.fast.requests) == 8  # none went through the router again


def test_a_killed_worker_is_restarted_and_its_slots_are_freed(tmp_path: Path) -> None:
    with workers(tmp_path) as cluster:
        before = cluster.pids()
        assert len(before) == 2
        # Hold requests on both workers, then kill one of them mid-stream.
        with ThreadPoolExecutor(JOB) as pool:
            held = [pool.submit(ask, cluster.url, "etl", tokens=200) for _ in range(JOB)]
            # On a busy machine the job's first requests may pass for interactive ones: wherever
            # they run, a pool's slots are full (what the killed worker held must come back).
            wait_until(lambda: SLOTS in (cluster.team.open, cluster.fast.open), message="streams under way")
            victim = min(before)
            os.kill(victim, signal.SIGKILL)
            outcomes = Counter(type(f.exception()).__name__ if f.exception() else "ok" for f in held)
        assert outcomes["ok"] >= 1 and sum(outcomes.values()) == JOB, outcomes
        wait_until(lambda: len(cluster.pids() - before) == 1 and len(cluster.pids()) == 2, message="a new worker")
        cluster.wait_sharing()
        cluster.team.wait_idle()
        cluster.fast.wait_idle()
        # The dead worker's slots went with it: a full job is served within the slots again,
        # here all of it on the new worker. The survivor holds a slot idle for its next requests
        # (state.lease_slots) and gives it back at a sync once the new worker needs it, so the
        # job's requests last a few syncs: the new worker's third request waits for that slot.
        [restarted] = re.findall(r"worker (\d+) \(pid \d+\) ended with signal 9", cluster.log.read_text())
        cluster.team.most_open = cluster.fast.most_open = 0
        assert wave(cluster.url, "etl2", tokens=60, uds=cluster.rundir / f"worker-{restarted}.sock")
        assert cluster.team.most_open <= SLOTS and cluster.fast.most_open <= SLOTS
        assert cluster.team.most_open + cluster.fast.most_open >= SLOTS


def test_a_flood_of_distinct_client_keys_keeps_the_shared_memory_bounded(tmp_path: Path) -> None:
    cap = 40
    with workers(tmp_path, state={"max_clients": cap}, classify={"client_memory_seconds": 600}) as cluster:
        # One SDK client, a key of its own for each request (`with_options` shares the client's
        # connections; one made for each request cost 40 ms of CPU, 6 s in all).
        with _client(cluster.url) as base, ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda n: _ask(base.with_options(api_key=f"flood-{n}"), "alice", 1), range(4 * cap)))
        shared = httpx.get(cluster.url + "/router/status", timeout=10).json()["workers"]["shared"]
        assert shared == {"workers": 2, "clients_remembered": cap}


def test_admin_calls_and_sighup_reach_every_worker(tmp_path: Path) -> None:
    with workers(tmp_path) as cluster:
        auth = {"authorization": f"Bearer {ADMIN_KEY}"}
        drained = httpx.post(cluster.url + "/admin/drain", json={"backend": "fast-1"}, headers=auth, timeout=10)
        assert drained.status_code == 200 and drained.json()["workers"]["answered"] == 2
        for view in cluster.each("/router/status"):
            assert view["pools"]["fast"]["backends"]["fast-1"]["draining"] is True
        data = yaml.safe_load(cluster.config.read_text())
        data["routing"] = {"ttft_target": 1.25}
        cluster.config.write_text(yaml.safe_dump(data))
        cluster.process.send_signal(signal.SIGHUP)
        wait_until(
            lambda: all(view["routing"]["ttft_target"] == 1.25 for view in cluster.each("/router/status")),
            message="both workers reloaded",
        )


def test_sigterm_drains_every_worker_and_exits_0(tmp_path: Path) -> None:
    with workers(tmp_path) as cluster:
        pids = cluster.pids()
        done: list[str] = []
        threads = [threading.Thread(target=lambda: done.append(ask(cluster.url, tokens=40))) for _ in range(4)]
        for thread in threads:
            thread.start()
        wait_until(lambda: cluster.fast.open >= 2, message="streams under way")
        cluster.process.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert cluster.process.wait(30) == 0
        for thread in threads:
            thread.join(10)
        assert len(done) == 4  # each stream ran to its end
        assert time.monotonic() - started < 25
        assert not any(Path(f"/proc/{pid}").exists() for pid in pids)
        assert not cluster.rundir.exists()


def test_a_crash_loop_stops_every_worker_and_exits_1(tmp_path: Path) -> None:
    with workers(tmp_path) as cluster:
        killed: set[int] = set()
        for _ in range(5):  # the fifth death within a minute is a crash loop
            wait_until(lambda: len(cluster.pids() - killed) == 2, message="two workers")
            pids = cluster.pids() - killed
            victim = min(pids)
            os.kill(victim, signal.SIGKILL)
            killed.add(victim)
        assert cluster.process.wait(30) == 1
        assert not any(Path(f"/proc/{pid}").exists() for pid in pids)
    assert "5 worker deaths within 60 s, stopping every worker" in cluster.log.read_text()


def _lone_worker(tmp: Path, supervisor: int) -> subprocess.Popen[str]:
    """A worker started as the supervisor starts one, naming `supervisor` (its parent is this test)."""
    config = tmp / "router.yaml"
    config.write_text(yaml.safe_dump(settings_data("http://127.0.0.1:9", "http://127.0.0.1:9")))
    port = free_port()
    args = ["--index", "0", "--supervisor", str(supervisor), "--workers", "1", "--rundir", str(tmp)]
    args += ["--config", str(config), "--host", "127.0.0.1", "--port", str(port)]
    with (tmp / "worker.log").open("w") as log:  # the worker has its own copy
        return subprocess.Popen(
            [sys.executable, "-m", "router.workers.worker", *args], stdout=log, stderr=log, text=True
        )


def test_a_worker_whose_supervisor_died_before_it_started_stops_once_it_serves(tmp_path: Path) -> None:
    # The supervisor killed while it restarted a worker: the new worker's parent is already gone.
    gone = subprocess.Popen(["true"])
    gone.wait()
    worker = _lone_worker(tmp_path, supervisor=gone.pid)
    try:
        assert worker.wait(timeout=60) == 0
    finally:
        worker.kill()
    assert "Application startup complete" in (tmp_path / "worker.log").read_text()  # it served, then stopped


def test_a_stop_signal_while_a_worker_starts_is_not_lost(tmp_path: Path) -> None:
    worker = _lone_worker(tmp_path, supervisor=os.getpid())
    time.sleep(0.3)  # importing the app: the signal lands before uvicorn handles signals
    worker.send_signal(signal.SIGTERM)
    try:
        assert worker.wait(timeout=60) in (0, -signal.SIGTERM)  # stopped, as asked, whenever it came
    finally:
        worker.kill()
