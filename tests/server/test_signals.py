"""`specroute serve` as its operator runs it: a real process, told what to do by signals.

SIGTERM: stop accepting, let running streams finish for the grace period, end the rest with one
error event, exit 0. SIGHUP: reload the file; an invalid one changes nothing.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from tests.conftest import SDK, settings_data
from tests.fake_engine import FakeEngine
from tests.servers import ServerThread, serve
from tests.wait import until, wait_until

pytestmark = pytest.mark.e2e  # `specroute serve` in its own process

GRACE = 3.0  # the short stream (about 0.5 s) ends well inside it even on a busy machine


@pytest.fixture
def engine() -> Iterator[tuple[FakeEngine, str]]:
    fake = FakeEngine(token_delay=0.05)
    with ServerThread(fake.app()) as server:
        yield fake, server.url


def _config(path: Path, url: str, **overrides: Any) -> Path:
    path.write_text(yaml.safe_dump(settings_data(url, url, **overrides)))
    return path


async def _stream(url: str, tokens: int, read: list[str], started: asyncio.Event) -> None:
    body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens}
    body["stream"] = True
    async with (
        httpx.AsyncClient(timeout=30) as client,
        client.stream("POST", url + "/v1/chat/completions", json=body) as response,
    ):
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                read.append(line[6:])
                if '"content"' in line:
                    started.set()


def test_sigterm_refuses_new_connections_lets_streams_finish_within_grace_then_ends_the_rest_and_exits_0(
    engine: tuple[FakeEngine, str], tmp_path: Path
) -> None:
    fake, engine_url = engine
    config = _config(tmp_path / "router.yaml", engine_url, shutdown={"grace_seconds": GRACE})
    with serve(config) as (process, url):

        async def scenario() -> tuple[list[str], list[str], float]:
            short: list[str] = []  # 10 tokens: about 0.5 s, inside the grace period
            long: list[str] = []  # 200 tokens: about 10 s, past it
            started = [asyncio.Event(), asyncio.Event()]
            tasks = [
                asyncio.create_task(_stream(url, 10, short, started[0])),
                asyncio.create_task(_stream(url, 200, long, started[1])),
            ]
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 10)
            process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()

            def refused() -> bool:  # the listener closes within uvicorn's 0.1 s tick
                try:
                    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=1):
                        return False
                except ConnectionRefusedError:
                    return True

            await until(lambda: asyncio.to_thread(refused), message="new connections refused")
            await asyncio.wait_for(tasks[0], 5)
            await asyncio.wait_for(tasks[1], GRACE + 5)
            return short, long, time.monotonic() - signalled

        short, long, ended_after = asyncio.run(scenario())
        assert process.wait(timeout=10) == 0
    assert short[-1] == "[DONE]" and sum('"content"' in e for e in short) == 10  # finished in the grace period
    assert GRACE * 0.9 <= ended_after < GRACE + 3  # ...the long one was ended at its end
    assert "[DONE]" not in long
    error = json.loads(long[-1])["error"]
    assert error["code"] == "shutting_down" and error["type"] == "service_unavailable"
    assert all("error" not in json.loads(e) for e in long[:-1])  # one error event, after what had come
    assert fake.wait_idle() and fake.aborted == 1  # and its upstream request was closed


def test_a_whole_answer_still_awaited_when_the_grace_period_ends_gets_503_shutting_down(
    engine: tuple[FakeEngine, str], tmp_path: Path
) -> None:
    fake, engine_url = engine
    config = _config(tmp_path / "router.yaml", engine_url, shutdown={"grace_seconds": 0.5})
    with serve(config) as (process, url):

        async def scenario() -> httpx.Response:
            body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200}
            async with httpx.AsyncClient(timeout=30) as client:
                waiting = asyncio.create_task(client.post(url + "/v1/chat/completions", json=body))
                await until(lambda: fake.open, message="the engine has the request")  # about 10 s of work
                process.send_signal(signal.SIGTERM)
                return await waiting

        response = asyncio.run(scenario())
        assert process.wait(timeout=10) == 0
    assert response.status_code == 503
    assert response.json()["error"] == {
        "message": "the router is shutting down; send the request again",
        "type": "service_unavailable",
        "param": None,
        "code": "shutting_down",
    }
    assert fake.wait_idle() and fake.aborted == 1  # the engine was told: its request closed


def test_the_openai_client_sees_the_shutdown_as_an_api_error_after_the_chunks_so_far(
    engine: tuple[FakeEngine, str], tmp_path: Path, sdk: SDK
) -> None:
    _, engine_url = engine
    config = _config(tmp_path / "router.yaml", engine_url, shutdown={"grace_seconds": 0.2})
    with serve(config) as (process, url):
        client = sdk(url)
        stream = client.chat.completions.create(
            model="test-model", messages=[{"role": "user", "content": "hi"}], max_tokens=200, stream=True
        )
        words: list[str] = []

        def read() -> None:
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    words.append(chunk.choices[0].delta.content)
                    if len(words) == 3:
                        process.send_signal(signal.SIGTERM)

        with pytest.raises(openai.APIError, match="shutting down"):
            read()
        assert process.wait(timeout=10) == 0
    assert words[:3] == ["w0 ", "w1 ", "w2 "] and len(words) < 200


def test_sighup_applies_a_valid_file_keeps_the_old_on_an_invalid_one_and_streams_go_on(
    engine: tuple[FakeEngine, str], tmp_path: Path
) -> None:
    _, engine_url = engine
    config = _config(tmp_path / "router.yaml", engine_url, routing={"mode": "adaptive"})
    with serve(config) as (process, url):

        def mode() -> str:
            routing: dict[str, str] = httpx.get(url + "/router/status").json()["routing"]
            return routing["mode"]

        def reloads(result: str) -> float:
            for line in httpx.get(url + "/metrics").text.splitlines():
                if line.startswith(f'specroute_config_reloads_total{{result="{result}"}}'):
                    return float(line.split()[-1])
            return 0.0

        async def scenario() -> list[str]:
            read: list[str] = []
            started = asyncio.Event()
            task = asyncio.create_task(_stream(url, 40, read, started))  # about 2 s
            await asyncio.wait_for(started.wait(), 10)
            _config(config, engine_url, routing={"mode": "static"})
            process.send_signal(signal.SIGHUP)
            await asyncio.to_thread(wait_until, lambda: mode() == "static", message="the new file applied")
            config.write_text("pools: [unclosed\n")
            process.send_signal(signal.SIGHUP)
            await asyncio.to_thread(wait_until, lambda: reloads("invalid") == 1, message="the invalid file refused")
            await asyncio.wait_for(task, 10)
            return read

        read = asyncio.run(scenario())
        assert mode() == "static"  # the invalid file changed nothing
        assert reloads("applied") == 1
        assert process.poll() is None  # and the router did not stop
    assert read[-1] == "[DONE]" and sum('"content"' in e for e in read) == 40
    log = (tmp_path / "router.log").read_text()
    assert "reload: applied; changed: routing.mode" in log
    assert "configuration not reloaded, the running one is kept" in log
