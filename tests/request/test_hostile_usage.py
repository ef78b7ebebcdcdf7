"""Hostile engines that report usage no engine could: token counts past any model's length
(a JSON integer too large for a float), negative, or not integers. The client gets the engine's
answer as it came; the router takes no count from it, and its metrics, its learned speeds, the
client's rate limits and every gauge stay sound for the next request.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from router.app import create_app
from router.config import Settings
from tests.raw_engine import Exchange, RawEngine, response
from tests.servers import ServerThread
from tests.wait import wait_until

pytestmark = pytest.mark.e2e  # the router served on loopback in front of a raw engine

ABSURD: list[Any] = [10**400, 10**30, -7, True, 2.5, "12", None]
CHAT = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _usage(exchange: Exchange) -> dict[str, Any]:
    """The request's `x-absurd` header picks the value reported for both counts."""
    value = ABSURD[int(exchange.headers.get("x-absurd", "-1"))] if "x-absurd" in exchange.headers else 3
    return {"prompt_tokens": value, "completion_tokens": value, "total_tokens": value}


async def _answer(exchange: Exchange, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    usage = _usage(exchange)
    if b'"stream": true' not in exchange.body:
        message = {"role": "assistant", "content": "a b c"}
        body = {"id": "c", "object": "chat.completion", "model": "test-model", "usage": usage,
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}  # fmt: skip
        writer.write(response(body=json.dumps(body).encode()))
        return True
    chunk = {"id": "c", "object": "chat.completion.chunk", "model": "test-model",
             "choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}]}  # fmt: skip
    last = {"id": "c", "object": "chat.completion.chunk", "model": "test-model", "choices": [], "usage": usage}
    events = b"".join(b"data: %s\n\n" % json.dumps(e).encode() for e in (chunk, chunk, last)) + b"data: [DONE]\n\n"
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n%s" % (len(events), events)
    )
    return True


@contextmanager
def _routed(engine: RawEngine) -> Iterator[tuple[httpx.Client, CollectorRegistry, Any]]:
    data: dict[str, Any] = {
        "pools": {"p": {"speculative": False, "backends": {"e": {"url": engine.url, "max_concurrency": 8}}}},
        "scrape": {"interval": 60},
        "health": {"interval": 60},
        "fairness": {"default_limits": {"tokens_per_minute": 10_000, "max_in_flight": 4}},
    }
    registry = CollectorRegistry()
    app = create_app(Settings(**data), registry=registry)
    with ServerThread(app, fast=True) as server, httpx.Client(base_url=server.url + "/v1", timeout=30) as client:
        yield client, registry, app


def _total(registry: CollectorRegistry, name: str) -> float:
    return sum(s.value for family in registry.collect() for s in family.samples if s.name == name)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_absurd_usage_counts_are_not_taken(stream: bool, caplog: pytest.LogCaptureFixture) -> None:
    extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    with RawEngine(_answer) as engine, _routed(engine) as (client, registry, app), caplog.at_level(logging.ERROR):
        for index, value in enumerate(ABSURD):
            answer = client.post("/chat/completions", json=CHAT | extra, headers={"x-absurd": str(index)})
            assert answer.status_code == 200, (value, answer.text)
            # The engine's answer went to the client as it came, its usage included.
            assert json.dumps(value) in answer.text, value
            assert int(answer.headers["x-ratelimit-remaining-tokens"]) > 9_900, value
        # Every request was counted; no count the engine gave was taken.
        wait_until(lambda: _total(registry, "specroute_requests_total") == len(ABSURD), message="all counted")
        assert _total(registry, "specroute_completion_tokens_total") == 0
        assert _total(registry, "specroute_prompt_tokens_total") == 0
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
        # The client's limits were given back and not poisoned: a sane answer still goes through.
        answer = client.post("/chat/completions", json=CHAT | extra)
        assert answer.status_code == 200, answer.text
        assert len(app.state.router.limiter) == 1  # one client, below its `max_in_flight` of 4 throughout
        assert 9_900 < int(answer.headers["x-ratelimit-remaining-tokens"]) <= 10_000
        wait_until(lambda: _total(registry, "specroute_completion_tokens_total") > 0, message="a sane count taken")
        assert _total(registry, "specroute_in_flight_requests") == 0
