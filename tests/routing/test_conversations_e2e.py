"""Conversations end to end: a pool of two simulated engines behind a real router."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from router.app import create_app
from router.config import Settings
from router.demo import cluster_settings, prefill_rate
from router.sim.profile import load_profile
from router.sim.server import create_sim_app
from tests.servers import ServerThread

pytestmark = pytest.mark.e2e

MODEL = "glm-5.3-flash"
CONTEXT = " ".join(f"line {i}: the harbour master logged the tide, the wind and the boats." for i in range(400))


def _metric(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture
def cluster(request: pytest.FixtureRequest) -> Iterator[tuple[ServerThread, list[ServerThread]]]:
    conversations: dict[str, Any] = getattr(request, "param", {})
    team = load_profile("team")
    with (
        ServerThread(create_sim_app(team, time_scale=20)) as one,
        ServerThread(create_sim_app(team, time_scale=20)) as two,
    ):
        data: dict[str, Any] = {
            "pools": {
                "team": {
                    "speculative": False,
                    "backends": {"team-1": {"url": one.url}, "team-2": {"url": two.url}},
                }
            },
            "scrape": {"interval": 0.05, "stale_after": 2},
            "batch": {"store_dir": tempfile.mkdtemp(prefix="specroute-batches-")},
            "conversations": conversations,
        }
        with ServerThread(create_app(Settings(**data), registry=CollectorRegistry()), fast=True) as router:
            yield router, [one, two]


def _talk(router: ServerThread, user: int, turns: int, headers: dict[str, str] | None = None) -> list[str]:
    """One conversation of `turns` turns; the backend each went to. After the first turn a long
    stream with the same beginning goes where the conversation is and stays there, so that its
    backend is the busier one of the two: the emptiest is the other."""
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": f"User {user}. {CONTEXT}"}]
    backends: list[str] = []
    blocker = None
    try:
        for turn in range(turns):
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=messages, max_tokens=8, extra_headers=headers or {}
            )
            backends.append(raw.headers["x-route-backend"])
            messages += [
                {"role": "assistant", "content": raw.parse().choices[0].message.content},
                {"role": "user", "content": f"Turn {turn}: and the next tide?"},
            ]
            if blocker is None:
                blocker = client.chat.completions.create(
                    model=MODEL, messages=messages[:1], max_tokens=4000, stream=True, extra_headers=headers or {},
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                next(iter(blocker))  # running now
    finally:
        if blocker is not None:
            blocker.close()
        client.close()
    return backends


def test_turns_stay_on_the_backend_holding_their_prefix(cluster: tuple[ServerThread, list[ServerThread]]) -> None:
    router, engines = cluster
    placed = [_talk(router, user, 5) for user in range(4)]
    # Each conversation's turns after the first went where its first did...
    assert all(len(set(backends)) == 1 for backends in placed), placed
    # ...and the engines found their prefixes: every later turn hit at least the context's blocks.
    hits = sum(_metric(e.url, "vllm:prefix_cache_hits_total") for e in engines)
    assert hits >= 4 * 4 * len(CONTEXT) // 4 * 0.9
    assert _metric(router.url, "specroute_prefix_placements_total", placed="prefix") == 16 + 4  # and the blockers
    assert _metric(router.url, "specroute_prefix_placements_total", placed="new") == 4


@pytest.mark.parametrize("cluster", [{"enabled": False}], indirect=True)
def test_without_conversations_turns_go_to_the_emptiest(cluster: tuple[ServerThread, list[ServerThread]]) -> None:
    """The reference: the same conversation leaves its backend for the emptiest, and the
    placement metric stays at zero."""
    router, _ = cluster
    backends = _talk(router, 0, 3)
    assert backends[1] != backends[0] and backends[2] != backends[0], backends
    assert _metric(router.url, "specroute_prefix_placements_total") == 0


def test_the_session_header_names_the_conversation(cluster: tuple[ServerThread, list[ServerThread]]) -> None:
    router, _ = cluster
    first = _talk(router, 0, 3, headers={"X-Session-ID": "abc"})
    assert len(set(first)) == 1, first
    # Another text in the same session: no block of it is known, the session names its backend.
    again = _talk(router, 1, 1, headers={"X-Session-ID": "abc"})
    assert again == first[:1]
    other = _talk(router, 2, 1, headers={"X-Session-ID": "xyz"})
    assert other == ["team-1"]  # a new session: the emptiest (on a tie, the first)


# Real time, and a first-token target of 1.5 s: a cold prompt of 20,000 tokens takes about 1.2 s
# to prefill alone, so the third or fourth sent at once is predicted late on one engine, however
# slowly a busy machine sends them.
SCALE = 1
TARGET = 1.5


def _long_prompts(count: int) -> list[str]:
    """Distinct cold prompts of about 20,000 tokens each: a coding agent's first turns."""
    return [f"Agent {n}. " + " ".join(f"file{n}_{i} = load({i}) + {n};" for i in range(2_000)) for n in range(count)]


@contextmanager
def _pools(conversations: dict[str, Any]) -> Iterator[str]:
    """A speculative and a standard simulated engine behind a router, its clocks as the embedded
    cluster's (router.demo) at `SCALE`."""
    fast, team = load_profile("fast"), load_profile("team")
    with (
        ServerThread(create_sim_app(fast, time_scale=SCALE)) as one,
        ServerThread(create_sim_app(team, time_scale=SCALE)) as two,
    ):
        settings = cluster_settings(
            {"fast": (True, [one.url]), "team": (False, [two.url])},
            host="127.0.0.1",
            port=0,
            time_scale=SCALE,
            ttft_target=TARGET,
            prefill_token_seconds=prefill_rate(fast),
        )
        data = settings.model_dump()
        data["conversations"].update(conversations)
        data["batch"]["store_dir"] = tempfile.mkdtemp(prefix="specroute-batches-")
        with ServerThread(create_app(Settings(**data), registry=CollectorRegistry()), fast=True) as router:
            yield router.url


def _first_turns(router: str, count: int) -> list[tuple[str, str]]:
    """Cold first turns sent one after another, each once the one before is under way (its
    answer's headers back): the pool and the reason of each."""
    clients = [openai.OpenAI(base_url=router + "/v1", api_key=f"agent-{n}", max_retries=0) for n in range(count)]
    seen, streams = [], []
    try:
        for client, prompt in zip(clients, _long_prompts(count), strict=True):  # each a client of its own
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=16, stream=True
            )
            seen.append((raw.headers["x-route-pool"], raw.headers["x-route-reason"]))
            streams.append(raw.parse())
    finally:
        for stream in streams:
            stream.close()
        for client in clients:
            client.close()
    return seen


def test_cold_long_prompts_queued_for_their_prefill_spill_to_the_sooner_first_token() -> None:
    """Several long cold prompts at once: one engine prefills them one after another. Once the
    speculative engine's queue would make the next one's first token late, it goes to the
    standard pool, where its first token comes sooner (`spill:spec-prefill`)."""
    with _pools({}) as router:
        seen = _first_turns(router, 8)
    assert seen[0] == ("fast", "default")  # an idle engine: the default place
    spilled = [reason for pool, reason in seen if pool == "team"]
    assert spilled and set(spilled) == {"spill:spec-prefill"}, seen
    assert sum(pool == "fast" for pool, _ in seen) >= 2, seen


def test_unpriced_cold_long_prompts_all_queue_on_the_speculative_engine() -> None:
    """The reference: without conversations priced the same prompts all go to the default place."""
    with _pools({"enabled": False}) as router:
        seen = _first_turns(router, 8)
    assert seen == [("fast", "default")] * 8


def _turn(client: openai.OpenAI, messages: list[Any], **headers: str) -> tuple[str, str, dict[str, float]]:
    """One turn: its pool, its reason and each pool's predicted first token (`X-Route-Predicted-TTFT`)."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=8, extra_headers=headers
    )
    messages += [
        {"role": "assistant", "content": raw.parse().choices[0].message.content},
        {"role": "user", "content": f"Turn {len(messages) // 2}: and the next tide?"},
    ]
    predicted = {}
    for part in raw.headers["x-route-predicted-ttft"].split(", "):
        pool, _, seconds = part.partition("=")
        predicted[pool] = float(seconds)
    return raw.headers["x-route-pool"], raw.headers["x-route-reason"], predicted


@pytest.mark.parametrize("batch", [True, False])
def test_a_conversation_leaves_a_standard_engine_running_batch_work_once(batch: bool) -> None:
    """A long conversation held by the standard engine goes back to the speculative pool, once,
    when that engine runs batch work and its whole prefill there is predicted within the target
    (`conversation:moved`); then it stays. Without batch work there, the same turn stays where its
    cache is (later ones may leave once the speculative pool is learned to be faster, as before)."""
    with (
        _pools({}) as router,
        openai.OpenAI(base_url=router + "/v1", api_key="talker", max_retries=0) as client,
        openai.OpenAI(base_url=router + "/v1", api_key="batch-job", max_retries=0) as batch_client,
    ):
        messages: list[Any] = [{"role": "user", "content": CONTEXT}]  # about 7,000 tokens
        assert _turn(client, messages, **{"X-Route-Pool": "team"})[:2] == ("team", "pinned")
        job = None
        if batch:
            job = batch_client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Summarise the tides."}], max_tokens=4000,
                stream=True, extra_headers={"X-Job-Type": "batch"}, extra_body={"ignore_eos": True},
            )  # fmt: skip
            next(iter(job))  # running on the standard engine now
        try:
            turns = [_turn(client, messages) for _ in range(3)]
        finally:
            if job is not None:
                job.close()
        moved = _metric(router, "specroute_route_decisions_total", reason="conversation:moved")
    if batch:
        pool, reason, predicted = turns[0]
        assert (pool, reason) == ("fast", "conversation:moved"), turns
        assert predicted["fast"] <= TARGET, predicted  # its whole prefill there, within the target
        assert [t[:2] for t in turns[1:]] == [("fast", "default")] * 2  # where its cache is now: no return
        assert moved == 1
    else:
        assert turns[0][:2] == ("team", "conversation:cached"), turns
