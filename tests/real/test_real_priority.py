"""Priority inside a real engine: vLLM started with `--scheduling-policy priority` (the session's
standard engine), behind a router whose pool says so (`priority_scheduling`).

The engine's 4,096-token KV cache holds two of the batch job's 1,500-token requests; the rest
wait inside the engine, without a first token. An interactive request sent then (priority 0
against the batch job's 100 and up) must get its first token before all but three of the batch
requests waiting ahead of it (those the engine had started when it arrived may come first); in
arrival order (`fcfs`) it would get it after all of them. The job lasts ten of the engine's
pairs, so that a loaded machine, where the engine answers `/metrics` in seconds, still finds it
queued.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest
from openai import OpenAI

from tests.real.conftest import RealCluster, router_in_front, router_settings
from tests.real.engines import MODEL, wait_for

pytestmark = [pytest.mark.real, pytest.mark.timeout(600)]

BATCH = 20  # batch requests: two run, eighteen wait inside the engine
AHEAD = 3  # of those queued when the interactive request was sent, how many may rightly come first
RUNNING = 2  # what the KV cache holds: once two have a first token, none is in its prefill
PROMPT = "once upon a time " * 250  # 1,519 tokens: with its answer 15 of the KV cache's 32 blocks
ANSWER = 380  # tokens; the longer a pair runs, the wider the moments the test must catch


def _stream(
    client: OpenAI, *, job: str, content: str, max_tokens: int, on_first: Callable[[float], object] = lambda t: None
) -> tuple[float, int]:
    """One streamed chat request pinned to `team`: when its first token came (told to `on_first`
    as it comes), and its prompt's tokens."""
    first = 0.0
    prompt_tokens = 0
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"X-Route-Pool": "team", "X-Job-Type": job},
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if not first and chunk.choices and chunk.choices[0].delta.content:
            first = time.monotonic()
            on_first(first)
        if chunk.usage is not None:
            prompt_tokens = chunk.usage.prompt_tokens
    assert first, "no token came"
    return first, prompt_tokens


@dataclass
class Round:
    waiting: list[float]  # the first tokens of the batch requests still queued when it was sent
    interactive: float  # the interactive request's, all from when it was sent
    prompts: list[int]


def _round(router: RealCluster, cluster: RealCluster) -> Round:
    """The batch job's requests filling the engine, then one interactive request sent right
    after the engine admitted the next of them."""
    batch_clients = [
        OpenAI(base_url=router.base_url, api_key="sk-batch-job", max_retries=0, timeout=300) for _ in range(BATCH)
    ]
    chat = OpenAI(base_url=router.base_url, api_key="sk-chat-user", max_retries=0, timeout=300)
    started = threading.Barrier(BATCH + 1)
    firsts: dict[int, float] = {}

    def batch(i: int) -> int:
        started.wait(timeout=60)
        content = f"{i}: {PROMPT}"
        _, prompt_tokens = _stream(
            batch_clients[i], job="batch", content=content, max_tokens=ANSWER, on_first=partial(firsts.__setitem__, i)
        )
        return prompt_tokens

    try:
        with ThreadPoolExecutor(max_workers=BATCH) as threads:
            futures = [threads.submit(batch, i) for i in range(BATCH)]
            started.wait(timeout=60)
            # The engine full: batch requests wait inside it, with no first token yet, and every
            # one without a first token is among them (not running, in its prefill: that one
            # would rightly come first).
            # (Or too few left to judge: a round that does not count.)
            wait_for(
                lambda: (
                    len(firsts) >= BATCH - AHEAD
                    or (
                        len(firsts) >= RUNNING
                        and cluster.team.metric("vllm:num_requests_waiting") >= BATCH - len(firsts)
                    )
                ),
                timeout=120,
                what="batch requests waiting inside the engine, none in its prefill",
            )
            # Right after the engine admitted the next ones (a first token came): the interactive
            # request then arrives the furthest from the next admission of the queue.
            seen = len(firsts)
            wait_for(lambda: len(firsts) > seen or seen == BATCH, timeout=120, what="the next batch request admitted")
            time.sleep(0.1)  # its partner of the same step
            sent = time.monotonic()
            waiting = [i for i in range(BATCH) if i not in firsts]
            interactive, _ = _stream(chat, job="interactive", content="Hi!", max_tokens=4)
            prompts = [future.result(timeout=400) for future in futures]
    finally:
        chat.close()
        for client in batch_clients:
            client.close()
    return Round(sorted(firsts[i] - sent for i in waiting), interactive - sent, prompts)


def test_an_interactive_first_token_comes_before_the_batch_work_queued_ahead(
    cluster: RealCluster, routers: Path
) -> None:
    assert cluster.team.scheduling == "priority"
    pools = router_settings(cluster.fast.url, cluster.team.url)["pools"]
    pools["team"]["priority_scheduling"] = True
    rounds: list[Round] = []
    with router_in_front(cluster.fast, cluster.team, routers, {"pools": pools}) as router:
        # A round judges only with a queue deeper than what may rightly come first (below); on a
        # loaded machine the engine may have admitted most of the job by then: another round.
        while len(rounds) < 3 and (not rounds or len(rounds[-1].waiting) <= AHEAD):
            rounds.append(_round(router, cluster))
    last = rounds[-1]
    assert min(last.prompts) >= 600, last.prompts  # the premise: each batch prompt takes several KV blocks
    assert len(last.waiting) > AHEAD, f"in {len(rounds)} rounds, never more than {AHEAD} batch requests queued"
    # In arrival order (`fcfs`) every one of them would get its first token before the interactive
    # request. By priority it overtakes the queue; only those the engine had started when it
    # arrived may come first: the partner of the admission it was sent after, one in its prefill,
    # and one the engine took while the request was on its way (the router's path and the
    # engine's HTTP server, a step of this engine on a loaded machine).
    ahead = sum(first < last.interactive for first in last.waiting)
    assert ahead <= AHEAD, (
        f"interactive first token at {last.interactive:.2f} s; the batch requests waiting ahead of it "
        f"got theirs at {[round(t, 2) for t in last.waiting]} s"
    )
