"""A conversation on the real engines through a spill episode: its turns go where its prefix is
cached, the engines' `vllm:prefix_cache_hits` counters show the hits, and it never alternates
between the engines turn by turn."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from tests.real.conftest import RealCluster
from tests.real.engines import MODEL, wait_for
from tests.real.test_real_load import long_requests

pytestmark = [pytest.mark.real, pytest.mark.timeout(600)]

CONTEXT = " ".join(f"Note {i}: the tide turned at the harbour wall and the boats came in." for i in range(24))
BLOCK = 128  # the real engines' KV block size


def test_a_conversation_keeps_its_cache_through_a_spill_episode(cluster: RealCluster) -> None:
    engines = {"fast": cluster.fast, "team": cluster.team}
    client = cluster.client()
    messages: list[Any] = [{"role": "user", "content": CONTEXT}]
    turns: list[dict[str, Any]] = []

    def turn(number: int) -> None:
        before = {pool: engine.metric("vllm:prefix_cache_hits_total") for pool, engine in engines.items()}
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=8, user="conversation", extra_body={"ignore_eos": True}
        )
        answer, pool = raw.parse(), raw.headers["x-route-pool"]
        assert answer.usage is not None
        hits = engines[pool].metric("vllm:prefix_cache_hits_total") - before[pool]
        turns.append({"pool": pool, "reason": raw.headers["x-route-reason"], "prompt": answer.usage.prompt_tokens,
                      "hits": hits})  # fmt: skip
        messages.append({"role": "assistant", "content": answer.choices[0].message.content})
        messages.append({"role": "user", "content": f"Turn {number}: and when does the tide turn next?"})

    def hit_the_turn_before(number: int) -> bool:
        """The turn found at least the whole blocks of the turn before it (all but the last)."""
        return bool(turns[number]["hits"] >= max(BLOCK, (turns[number - 1]["prompt"] // BLOCK - 1) * BLOCK))

    for number in range(3):
        turn(number)

    # The speculative engine filled by other users: its KV cache full, requests waiting in it, as
    # its own gauges show either (once, on a fresh engine, 60 s of polls saw none waiting while the
    # sixteen ran about four at a time).
    def filled() -> bool:
        engine = cluster.fast
        return engine.metric("vllm:num_requests_waiting") > 0 or engine.metric("vllm:kv_cache_usage_perc") >= 0.9

    with long_requests(cluster, "fast", 16):
        wait_for(filled, timeout=60, what="fast's KV cache full or requests waiting in it")
        for number in range(3, 5):
            turn(number)
    wait_for(cluster.idle, timeout=120, what="the long requests done")
    for number in range(5, 8):
        turn(number)

    table = "\n".join(f"turn {i}: {t}" for i, t in enumerate(turns))
    print(table)
    pools = [t["pool"] for t in turns]
    # Before the episode: the speculative pool, each turn on the blocks of the one before.
    assert pools[:3] == ["fast"] * 3, table
    assert hit_the_turn_before(1) and hit_the_turn_before(2), table
    # Never alternating: at most one change of engine in the whole conversation.
    assert sum(a != b for a, b in itertools.pairwise(pools)) <= 1, table
    # After the episode it stays where it is, on its cache there from the first turn after: had
    # it stayed on the filled speculative engine, the long requests would have evicted it.
    assert pools[5] == pools[6] == pools[7], table
    assert all(hit_the_turn_before(number) for number in (5, 6, 7)), table
    # The router counted those turns as placed on their prefix's backend.
    placed = cluster.router_metric("specroute_prefix_placements_total", pool=pools[7], placed="prefix")
    assert placed is not None and placed >= 2
