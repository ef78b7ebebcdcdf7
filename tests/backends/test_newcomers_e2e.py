"""Room over the cap for a newcomer, end to end: the simulated speculative engine, a real
router capped at four requests on it, an agent holding all four, and a chat user asking with the
official `openai` client."""

from __future__ import annotations

import asyncio
import tempfile
import time
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
from tests.wait import until

pytestmark = pytest.mark.e2e

MODEL = load_profile("fast").model


def _router(fast: str, newcomer_slots: int) -> ServerThread:
    data: dict[str, Any] = {
        "pools": {"fast": {"speculative": True, "backends": {"fast-1": {"url": fast, "max_concurrency": 4}}}},
        "routing": {"mode": "static"},
        "scrape": {"interval": 0.05, "stale_after": 2},
        "classify": {"batch_inflight_threshold": 64, "burst_hold_seconds": 0},
        "fairness": {"newcomer_slots": newcomer_slots},
        "batch": {"store_dir": tempfile.mkdtemp(prefix="specroute-batches-")},
    }
    return ServerThread(create_app(Settings(**data), registry=CollectorRegistry()), fast=True)


async def _agent(base_url: str, ended: list[float], max_tokens: int) -> None:
    agent = openai.AsyncOpenAI(base_url=base_url, api_key="sk-agent", max_retries=0)
    try:
        stream = await agent.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "write the module"}],
            max_tokens=max_tokens,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for _ in stream:
            pass
        ended.append(time.monotonic())
    finally:
        await agent.close()


async def _first_token(base_url: str, key: str) -> float:
    """When a chat user's first token arrives."""
    user = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0)
    try:
        stream = await user.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello?"}], max_tokens=8, stream=True
        )
        first = None
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.monotonic()
        assert first is not None
        return first
    finally:
        await user.close()


async def _status(client: httpx.AsyncClient, router: str) -> dict[str, Any]:
    return dict((await client.get(router + "/router/status")).json()["pools"]["fast"])


async def _seen_running(client: httpx.AsyncClient, router: str, running: int) -> bool:
    return bool((await _status(client, router))["backends"]["fast-1"]["engine"]["running"] == running)


@pytest.mark.parametrize("newcomer_slots", [4, 0])
def test_a_newcomer_is_not_made_to_wait_for_an_agent_holding_every_slot(newcomer_slots: int) -> None:
    with (
        ServerThread(create_sim_app(load_profile("fast"), time_scale=4)) as fast,
        _router(fast.url, newcomer_slots) as router,
    ):

        async def scenario() -> tuple[float, list[float], dict[str, Any], str]:
            ended: list[float] = []
            base_url = router.url + "/v1"
            # Long answers with room over the cap (they must outlast the user's wait on a busy
            # machine), short ones without (the user waits for one to end).
            agents = [asyncio.create_task(_agent(base_url, ended, 2000 if newcomer_slots else 512)) for _ in range(4)]
            # The agent holds every slot, and a reading of the engine shows its four running.
            async with httpx.AsyncClient() as client:
                await until(lambda: _seen_running(client, router.url, 4), message="the engine seen running four")
                # Four users at once, the bound: four more requests to the engine than the cap,
                # the router's connections to it and its scrapes included.
                firsts = await asyncio.gather(*(_first_token(base_url, f"sk-chat-{n}") for n in range(4)))
                first = max(firsts)
                status = await _status(client, router.url)
                metrics = (await client.get(router.url + "/metrics")).text
            for task in agents:
                task.cancel()
            await asyncio.gather(*agents, return_exceptions=True)
            return first, ended, status, metrics

        first, ended, status, metrics = asyncio.run(scenario())
        admitted = [line for line in metrics.splitlines() if line.startswith("specroute_newcomer_requests_total")]
        if newcomer_slots:
            # Over the cap at once: its first token came while all four of the agent's ran.
            assert not ended or first < min(ended), (first, ended)
            assert status["clients"]["newcomer_slots"] == 4 and status["clients"]["newcomers_admitted"] == 4
            assert admitted == ['specroute_newcomer_requests_total{pool="fast"} 4.0']
        else:
            # Without it, the users wait for the agent's answers to end.
            assert ended and first > min(ended), (first, ended)
            assert admitted == ['specroute_newcomer_requests_total{pool="fast"} 0.0']
