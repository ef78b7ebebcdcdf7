"""Tokens-per-minute limits against prompts that are not text: token ids (a list of them, a list
of such lists) and inputs given as lists. What a request is charged on arrival is its prompt's
size, so a burst of such requests cannot pass a limit that one of them fills."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.conftest import running_cluster
from tests.wait import wait_until

pytestmark = pytest.mark.e2e  # the router served on loopback in front of fake engines

LIMITS = {"default_limits": {"tokens_per_minute": 1000}}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/completions", {"prompt": list(range(300)), "max_tokens": 1}),
        ("/completions", {"prompt": [list(range(100)), list(range(200))], "max_tokens": 1}),
        ("/embeddings", {"input": list(range(300))}),
        ("/embeddings", {"input": ["abcd" * 100, "abcd" * 200]}),
    ],
    ids=["ids", "lists-of-ids", "input-ids", "input-texts"],
)
def test_a_prompt_that_is_not_text_is_charged_its_size(path: str, body: dict[str, Any]) -> None:
    with running_cluster(fairness=LIMITS) as cluster:
        answer = httpx.post(cluster.base_url + path, json={"model": "test-model", **body}, timeout=30)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-ratelimit-remaining-tokens"] == "700"  # 300 tokens taken on arrival


def test_a_burst_of_token_id_prompts_is_held_to_the_limit() -> None:
    body = {"model": "test-model", "prompt": list(range(900)), "max_tokens": 1}
    with running_cluster(fairness=LIMITS) as cluster:
        cluster.fast.gate = cluster.team.gate = threading.Event()  # the first holds its tokens
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(httpx.post, cluster.base_url + "/completions", json=body, timeout=30)
            wait_until(lambda: len(cluster.fast.requests) + len(cluster.team.requests) == 1, message="one admitted")
            refused = [httpx.post(cluster.base_url + "/completions", json=body, timeout=30) for _ in range(3)]
            cluster.fast.gate.set()
            assert first.result().status_code == 200
        for answer in refused:
            assert answer.status_code == 429, answer.text
            error = answer.json()["error"]
            assert (error["type"], error["code"]) == ("tokens", "rate_limit_exceeded")
        assert len(cluster.fast.requests) + len(cluster.team.requests) == 1  # nothing else forwarded
