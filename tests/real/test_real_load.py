"""What the router reads from real engines under load, and what it does with it.

Timing on two shared cores varies a lot, so every check waits for its condition with a
deadline; the loads are sized so that the condition holds for seconds, not for one instant
(16 requests of 1,500 tokens keep the speculative engine's 4,096-token KV cache full and
requests waiting for about 15 s).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from openai.types.chat import ChatCompletion

from tests.real.conftest import RealCluster, router_in_front
from tests.real.engines import wait_for

# Engines restart and queues drain at the speed of two CPU cores: far past the suite's default timeout.
pytestmark = [pytest.mark.real, pytest.mark.timeout(600)]

LONG = 1500  # tokens per long request: with its prompt, 12 of the KV cache's 32 blocks of 128


@contextmanager
def long_requests(
    cluster: RealCluster, pool: str, count: int
) -> Iterator[list[Future[tuple[str, str, ChatCompletion]]]]:
    """`count` long requests pinned to `pool`, sent together and running while the block runs;
    all must succeed. Their clients are made first: making one takes tens of milliseconds of CPU,
    which two busy engines stretched so far that once the sixteen arrived over 12 s, two or three
    at a time, each served in 1-4 s, and the engine never had one waiting."""
    clients = [cluster.new_client() for _ in range(count)]
    together = threading.Barrier(count)

    def send(number: int) -> tuple[str, str, ChatCompletion]:
        together.wait(timeout=60)
        story = f"Story {number}: once upon"
        return cluster.chat(user=f"long-{number}", pool=pool, max_tokens=LONG, content=story, client=clients[number])

    try:
        with ThreadPoolExecutor(max_workers=count) as threads:
            futures = [threads.submit(send, number) for number in range(count)]
            yield futures
            for future in futures:
                served, _, answer = future.result(timeout=300)
                assert served == pool and answer.usage is not None and answer.usage.completion_tokens == LONG
    finally:
        for client in clients:
            client.close()


def test_memory_of_each_engine(real: RealCluster) -> None:
    for engine in (real.fast, real.team):
        assert 500 < engine.memory_mib() < 3.5 * 1024  # about 2.2 GiB each on this machine kind


def test_the_scraper_reads_the_real_engines(cluster: RealCluster) -> None:
    # What the router's view of fast-1 showed while the load ran, each figure at its highest.
    # They need not all show in one view: a load of a few short answers can end between two
    # scrapes that could show them together, so the load is sixteen long answers (the KV cache
    # holds a few; the rest wait in the engine) and each figure is judged on its own.
    seen: dict[str, float] = {}
    views: list[dict[str, Any]] = []

    def loaded() -> bool:
        engine = cluster.backend("fast")["engine"]
        views[:] = [engine]
        for key in ("running", "waiting", "kv_usage", "acceptance", "accept_length"):
            if engine[key] is not None:
                seen[key] = max(seen.get(key, 0.0), engine[key])
        return bool(seen.get("running")) and bool(seen.get("kv_usage")) and "acceptance" in seen

    def last_view() -> str:
        return f"the router's view of fast-1 showed running, KV usage and acceptance; seen {seen}, last {views}"

    with long_requests(cluster, "fast", 16):
        wait_for(loaded, timeout=90, what=last_view)
        labels = {"pool": "fast", "backend": "fast-1"}
        wait_for(
            lambda: (cluster.router_metric("specroute_engine_running_requests", **labels) or 0) > 0,
            timeout=30,
            what="specroute_engine_running_requests of fast-1 above 0",
        )
        assert (cluster.router_metric("specroute_engine_kv_cache_usage_ratio", **labels) or 0) > 0
        assert cluster.router_metric("specroute_engine_waiting_requests", **labels) is not None
        assert cluster.router_metric("specroute_engine_scrape_stale", **labels) == 0
    assert 1 <= seen["running"] <= 16
    assert 0 <= seen["waiting"] <= 16
    assert 0 < seen["kv_usage"] <= 1
    # ngram drafts on the looping random model are mostly right (about 60 %), never all wrong.
    assert 0 < seen["acceptance"] <= 1
    assert 1 < seen["accept_length"] <= 5  # 4 drafted + 1
    # The standard engine drafts nothing.
    team = cluster.backend("team")["engine"]
    assert team["acceptance"] is None and team["running"] is not None and not team["stale"]
    # Once the load is over, the router's view follows the engine back down.
    wait_for(lambda: cluster.backend("fast")["engine"]["running"] == 0, timeout=30, what="fast-1 scraped idle")


def test_a_client_that_disconnects_is_aborted_in_the_engine(cluster: RealCluster) -> None:
    def finished() -> float:  # sequences that ran to the end (max_tokens, with ignore_eos)
        return cluster.team.metric("vllm:request_success_total", finished_reason="length")

    finished_before = finished()
    tokens_before = cluster.team.metric("vllm:generation_tokens_total")
    # The tiny model decodes a 1,800-token answer in about a second on an idle core, so one
    # answer could end before any abort arrived. Sixteen of them hold 28,800 tokens of KV against
    # the engine's 4,096: most wait inside the engine, and the engine works on them for 45 s or
    # more. The router must get to the client's leaving within that time, even on a shared
    # machine where its process can get no turn for many seconds while the pinned engine goes on.
    sequences = 16
    stream = cluster.client().chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "A long story, please."}],
        max_tokens=1800,
        n=sequences,
        temperature=1.0,  # vLLM takes n > 1 only when sampling
        stream=True,
        extra_headers={"X-Route-Pool": "team"},
        extra_body={"ignore_eos": True},
    )
    for _, _chunk in zip(range(2), stream, strict=False):
        pass
    stream.close()  # the client goes away mid-stream

    def idle() -> bool:
        return cluster.team.metric("vllm:num_requests_running") + cluster.team.metric("vllm:num_requests_waiting") == 0

    # Within the time all of them would take, should the abort never come.
    wait_for(idle, timeout=300, what="team engine idle")
    # Stopped, not finished: had the router not closed the request, all the sequences would have
    # run to max_tokens (vLLM 0.32 counts an aborted one under no finished_reason).
    assert finished() - finished_before < sequences
    assert cluster.team.metric("vllm:generation_tokens_total") - tokens_before < sequences * 1800
    labels = {"pool": "team", "backend": "team-1"}
    wait_for(
        lambda: cluster.router_metric("specroute_in_flight_requests", **labels) == 0,
        timeout=10,
        what="the router's in-flight gauge back to 0",
    )


def test_interactive_work_spills_when_the_speculative_engine_is_full(cluster: RealCluster) -> None:
    served, reason, _ = cluster.chat(user="probe", job="interactive")
    assert (served, reason) == ("fast", "header")  # idle: interactive work goes to the speculative pool
    wanted = {"spill:spec-kv-full", "spill:spec-queueing"}
    probes: list[Future[tuple[str, str, ChatCompletion]]] = []

    def spilled() -> bool:
        return any(p.done() and p.result()[0] == "team" and p.result()[1] in wanted for p in probes)

    def decisions() -> str:
        return str(Counter(p.result()[:2] for p in probes if p.done()))

    with long_requests(cluster, "fast", 16) as long, ThreadPoolExecutor(max_workers=32) as senders:
        # A probe every 0.2 s, without waiting for the one before: one that went to `fast` waits
        # there behind the long requests. Each is one decision on the router's latest reading.
        deadline = time.monotonic() + 90
        while not spilled() and not all(future.done() for future in long) and time.monotonic() < deadline:
            probes.append(senders.submit(cluster.chat, user="probe", job="interactive", max_tokens=2))
            time.sleep(0.2)
        assert spilled(), f"no spill for a full KV cache or a queue while the engine was full; {decisions()}"
    for probe in probes:  # every probe was answered, wherever it went
        answer = probe.result()[2]
        assert answer.usage is not None and answer.usage.completion_tokens == 2
    # Never because the router's own slots ran out: it had room for more than the engine.
    assert not any(probe.result()[1] == "spill:spec-full" for probe in probes)
    # Once the long requests are done, interactive work goes back to the speculative pool.
    wait_for(
        lambda: cluster.chat(user="probe", job="interactive", max_tokens=2)[:2] == ("fast", "header"),
        timeout=30,
        what="interactive work back on fast",
    )


BURST = 24  # users arriving together
BURST_TOKENS = 200  # with its prompt, 2 of a KV cache's 32 blocks: each engine holds 16 such requests
FAST_HOLDS = 16
ROUNDS = 3
Burst = tuple[Counter[tuple[str, str]], int]


def burst(cold: RealCluster) -> Burst:
    """`BURST` interactive users at the same moment on `cold`: how many each pool served and why,
    and the most requests the router had in flight on both pools at once. The engines' caches hold
    32 of them together, the speculative one 16: past that it preempts some (to recompute them
    later), which its own count shows however the users' arrival spread on a busy machine."""
    preempted = cold.fast.metric("vllm:num_preemptions_total")
    clients = [cold.new_client() for _ in range(BURST)]  # made beforehand: that takes a while
    together = threading.Barrier(BURST)
    done = threading.Event()
    peak = 0

    def watch() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, sum(cold.backend(pool)["in_flight"] for pool in ("fast", "team")))
            time.sleep(0.02)

    def user(i: int) -> tuple[str, str]:
        together.wait(timeout=30)
        served, reason, answer = cold.chat(
            user=f"burst-{i}", job="interactive", max_tokens=BURST_TOKENS, client=clients[i]
        )
        assert answer.usage is not None and answer.usage.completion_tokens == BURST_TOKENS
        return served, reason

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(max_workers=BURST) as threads:
            decisions = Counter(threads.map(user, range(BURST)))
    finally:
        done.set()
        watcher.join()
        for client in clients:
            client.close()
    assert cold.fast.metric("vllm:num_preemptions_total") == preempted, decisions
    return decisions, peak


def judged(rounds: list[Burst]) -> bool:
    """Whether the last burst went past what the speculative engine holds, and if so that it
    spilled past that capacity, on its projected KV cache, the rest staying there. A burst whose
    requests never overlapped that much (a busy machine spreads 24 threads' requests out, and
    those that end make room: CI once saw all 24 on `fast`, rightly) cannot judge the spill, and
    another runs; after `ROUNDS` such, the test skips, saying so."""
    decisions, peak = rounds[-1]
    if peak > FAST_HOLDS:
        spilled = sum(count for (served, reason), count in decisions.items() if served == "team")
        assert spilled >= 1 and decisions["fast", "header"] >= BURST // 4, decisions
        reasons = {reason for served, reason in decisions if served == "team"}
        assert reasons <= {"spill:spec-kv-full", "spill:spec-queueing"}, decisions
        return True
    if len(rounds) == ROUNDS:
        most = max(peak for _, peak in rounds)
        pytest.skip(f"{ROUNDS} bursts had at most {most} requests in flight at once: no spill to judge")
    return False


def first_readings(cold: RealCluster) -> None:
    wait_for(
        lambda: all(cold.backend(pool)["engine"]["age_seconds"] is not None for pool in ("fast", "team")),
        timeout=30,
        what="the cold router's first reading of both engines",
    )


def engines_idle(cluster: RealCluster) -> None:
    wait_for(
        lambda: (
            cluster.fast.metric("vllm:num_requests_running") + cluster.team.metric("vllm:num_requests_running") == 0
        ),
        timeout=120,
        what="both engines idle before a burst",
    )


def test_a_burst_of_users_on_a_cold_router_spills_past_the_speculative_engines_capacity(
    cluster: RealCluster, routers: Path
) -> None:
    """On a router that has never seen the engines loaded: its one reading shows both idle. The
    burst must spill to the standard engine once the speculative one's stated capacity (2
    requests of full length) is taken, though both pools' predicted first tokens start equal.
    Each round a new, cold router."""
    rounds: list[Burst] = []
    while not rounds or not judged(rounds):
        engines_idle(cluster)
        with router_in_front(cluster.fast, cluster.team, routers) as cold:
            first_readings(cold)
            rounds.append(burst(cold))


def test_a_burst_after_short_requests_is_not_taken_for_short_requests(cluster: RealCluster, routers: Path) -> None:
    """The router has seen short requests running on the speculative engine (a prompt and 50
    tokens: 1 block each; pinned there) and finishing there, and none on the standard one. Their one block
    each must not be taken for what each of the burst will hold (27 would fit, and the speculative
    engine would preempt): each takes the blocks its own length needs, and a pool with no request
    measured takes the others' duration. Each round a new router, that has seen only those."""
    rounds: list[Burst] = []
    while not rounds or not judged(rounds):
        engines_idle(cluster)
        with router_in_front(cluster.fast, cluster.team, routers) as cold:
            first_readings(cold)
            seen_short(cold)
            assert cold.backend("team")["ttft_seconds"]["samples"] == 0  # the standard pool measured nothing
            rounds.append(burst(cold))


def seen_short(cold: RealCluster) -> None:
    """Until the router's reading of the speculative engine shows short requests running there."""
    seen = threading.Event()

    def short_requests(i: int) -> None:
        with cold.new_client() as client:
            while not seen.is_set():
                cold.chat(user=f"short-{i}", pool="fast", max_tokens=50, client=client)

    with ThreadPoolExecutor(max_workers=2) as threads:
        loops = [threads.submit(short_requests, i) for i in range(2)]
        try:
            wait_for(
                lambda: cold.backend("fast")["engine"]["kv_per_request"] < 0.05,  # 1 block: vLLM says 1/31
                timeout=60,
                what="a reading of the speculative engine with short requests running",
            )
        finally:
            seen.set()
        for loop in loops:
            loop.result()


def test_drain_and_resume(cluster: RealCluster) -> None:
    stream = cluster.client().chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "A story that outlives the drain."}],
        max_tokens=400,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = [next(stream)]  # it started on fast
    try:
        drained = cluster.admin("drain", {"pool": "fast"})
        assert drained.status_code == 200
        assert drained.json()["backends"][0]["draining"] is True
        served, reason, _ = cluster.chat(user="while-drained")
        assert (served, reason) == ("team", "spill:spec-draining")
        chunks.extend(stream)  # the request that was running finishes, whole
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 400
        resumed = cluster.admin("resume", {"pool": "fast"})
        assert resumed.status_code == 200 and resumed.json()["backends"][0]["draining"] is False
    finally:
        cluster.admin("resume", {"pool": "fast"})
    served, reason, _ = cluster.chat(user="after-resume")
    assert (served, reason) == ("fast", "default")


def test_an_engine_killed_under_load_fails_over_and_returns(cluster: RealCluster) -> None:
    logged_before = len(cluster.log_lines())

    def changes() -> list[tuple[int, str]]:  # what the router logged of fast-1 during this test
        return cluster.backend_changes("fast-1", since=logged_before)

    outcomes: list[tuple[str, str]] = []
    failures: list[BaseException] = []
    stop = threading.Event()

    def load(worker: int) -> None:
        while not stop.is_set():
            try:
                served, reason, _ = cluster.chat(user=f"steady-{worker}", max_tokens=16)
                outcomes.append((served, reason))
            except Exception as exc:
                failures.append(exc)

    workers = [threading.Thread(target=load, args=(i,)) for i in range(3)]
    for worker in workers:
        worker.start()
    try:
        wait_for(lambda: ("fast", "default") in outcomes, timeout=30, what="steady load served on fast")
        # Killed with the three workers' requests running on it: they fail together and eject it at
        # once, and three retries at once are what the retry budget always allows
        # (retries.min_concurrent). Killed at any time, the third failure could wait for a
        # failed-over answer from team (1.1-2.3 s on a busy machine), racing the two failed health
        # checks (1-2 s) that take it out without an ejection.
        wait_for(lambda: cluster.backend("fast")["in_flight"] == 3, timeout=30, what="three requests on fast-1")
        # Counted before the kill: `kill` waits for the engine to be reaped, and the failed-over
        # answers can come back meanwhile.
        killed_at = len(outcomes)
        cluster.fast.kill()
        # Seen before anything else is waited for: the ejection lasts 10 s from the kill.
        wait_for(lambda: cluster.backend("fast")["ejected_seconds_left"] > 0, timeout=10, what="fast-1 ejected")
        # Requests that found fast-1 gone are retried on team before any byte reached the client.
        wait_for(
            lambda: any(reason == "failover:fast" for _, reason in outcomes[killed_at:]),
            timeout=30,
            what="a request failed over from fast to team",
        )
        wait_for(lambda: not cluster.backend("fast")["healthy"], timeout=30, what="fast-1 unhealthy")
        wait_for(lambda: outcomes[-1] == ("team", "spill:spec-down"), timeout=30, what="new work sent to team at once")

        cluster.fast.restart()
        wait_for(lambda: cluster.backend("fast")["healthy"], timeout=60, what="fast-1 back in the router")
        back_at = len(outcomes)
        wait_for(lambda: ("fast", "default") in outcomes[back_at:], timeout=30, what="work on fast-1 again")
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=120)
        if not cluster.fast.healthy():  # failed before its restart: the tests after it need it back
            cluster.fast.restart()
    # Not one request of the steady load was lost: those running on fast-1 when it died were
    # answered by team (none had sent a byte to its client).
    assert failures == []
    served_by = Counter(served for served, _ in outcomes)
    assert served_by["fast"] > 0 and served_by["team"] > 0

    # The log says it all, one line per change: ejected by the failing requests; its engine still
    # down when the 10 s are over (a restart takes about 90 s); back; and its /metrics unread
    # meanwhile (stale after 15 s, fresh again once the engine answers).
    wait_for(
        lambda: any(line.endswith("engine readings fresh again") for _, line in changes()),
        timeout=10,
        what="fast-1's engine readings logged fresh again",
    )
    lines = changes()
    head = "backend fast-1 (pool fast) "
    ejected = (logging.WARNING, head + "ejected for 10 s: 3 requests failed in a row")
    still_down = (logging.WARNING, head + "still unhealthy after its ejection: 2 health checks failed")
    returned = (logging.INFO, head + "returned after ejection (10 s): 2 health checks passed")
    fresh = (logging.INFO, head + "engine readings fresh again")
    stale = [line for line in lines if line[1].startswith(head + "engine readings stale (no good scrape for ")]
    assert len(stale) == 1 and stale[0][0] == logging.WARNING, lines
    assert sorted(lines) == sorted([ejected, still_down, returned, fresh, stale[0]]), lines
    assert lines.index(ejected) < lines.index(still_down) < lines.index(returned), lines
    assert lines.index(stale[0]) < lines.index(fresh), lines
