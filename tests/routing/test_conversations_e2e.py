"""Conversations end to end: a pool of two simulated engines behind a real router."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from router.app import create_app
from router.config import Settings
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
