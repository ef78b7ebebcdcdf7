"""Log lines: text or JSON, UTC timestamps, an access line with what an operator asks of a request."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.clock import ManualClock
from router.logs import JsonFormatter, TextFormatter
from tests.conftest import Cluster
from tests.wait import wait_until

# The access line's fields, in order (docs/operating.md, "Logs").
ACCESS_FIELDS = "id path model client job reason pool backend status code retries queue_ms ttft_ms tokens duration_ms"


def _records(caplog: pytest.LogCaptureFixture, count: int) -> list[logging.LogRecord]:
    def access() -> list[logging.LogRecord]:
        found = [r for r in caplog.records if r.name == "specroute.access"]
        return found if len(found) >= count else []

    # The router logs just after the last byte, in its own thread.
    return wait_until(access, timeout=2, interval=0.005, message=f"{count} access lines")


@pytest.mark.e2e
def test_access_line_as_json_and_text(cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="specroute.access"):
        client = cluster.client("sk-secret-key-123")
        for _chunk in client.chat.completions.create(
            model="test-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
        ):
            pass
        [record] = _records(caplog, 1)
    entry = json.loads(JsonFormatter().format(record))
    assert [key for key in entry if key not in ("time", "level", "logger", "message")] == ACCESS_FIELDS.split()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", entry["time"])
    assert entry["model"] == "test-model"
    assert (entry["job"], entry["reason"], entry["pool"], entry["backend"]) == (
        "interactive",
        "default",
        "fast",
        "fast-1",
    )
    assert (entry["status"], entry["code"], entry["retries"], entry["tokens"]) == (200, None, 0, 3)
    assert entry["ttft_ms"] >= 0 and entry["duration_ms"] >= entry["ttft_ms"] and entry["queue_ms"] >= 0
    # No client keys are configured, but a key that is no placeholder still tells clients apart:
    # the client is the key, shown only as a hash.
    assert re.fullmatch(r"key:[0-9a-f]{12}", entry["client"])
    text = TextFormatter().format(record)
    assert "sk-secret-key-123" not in text + json.dumps(entry)
    assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z INFO specroute.access id=", text)
    assert [pair.split("=")[0] for pair in text.split(" ")[3:]] == ACCESS_FIELDS.split()
    assert f"client={entry['client']} " in text and " code=- " in text


@pytest.mark.e2e
def test_error_code_in_the_access_line(cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="specroute.access"):
        httpx.post(cluster.base_url + "/chat/completions", content=b"[1, 2", headers={"X-Request-Id": "r1"})
        [record] = _records(caplog, 1)
    entry = json.loads(JsonFormatter().format(record))
    assert (entry["id"], entry["status"], entry["code"], entry["pool"]) == ("r1", 400, "invalid_json", None)
    assert entry["client"] is None  # who a client is depends on its body's `user`, which was unreadable


def test_the_docs_document_every_access_field_and_both_formats() -> None:
    readme = (Path(__file__).resolve().parent.parent / "docs" / "operating.md").read_text()
    section = readme.split("\n## Logs\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (`[^|]+`) \|", section, flags=re.MULTILINE)
    assert [name for row in rows for name in re.findall(r"`(\w+)`", row)] == ACCESS_FIELDS.split()
    text = re.search(r"^\S+ INFO specroute\.access (.+)$", section, flags=re.MULTILINE)
    assert text is not None and [pair.split("=")[0] for pair in text[1].split(" ")] == ACCESS_FIELDS.split()
    line = re.search(r"^\{.+\}$", section, flags=re.MULTILINE)
    assert line is not None
    assert list(json.loads(line[0])) == ["time", "level", "logger", "message", *ACCESS_FIELDS.split()]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.mark.e2e  # the demo in its own process
def test_demo_listens_where_the_environment_says_and_logs_json() -> None:
    # In a container SPECROUTE_LISTEN__HOST=0.0.0.0: the embedded demo must take it. 127.0.0.2 is
    # loopback too, but reaches only a socket bound to all addresses, not one on 127.0.0.1.
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECROUTE_")}
    env["SPECROUTE_LISTEN__HOST"] = "0.0.0.0"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "router.cli",
            "serve",
            "--port",
            str(port),
            "--time-scale",
            "10",
            "--log-format",
            "json",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert process.stderr is not None
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(f"http://127.0.0.2:{port}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, "the demo is not reachable on 127.0.0.2"
            time.sleep(0.05)
        answer = httpx.post(
            f"http://127.0.0.2:{port}/v1/completions",
            json={"model": "glm-5.3-flash", "prompt": "x", "max_tokens": 2},
            timeout=30,
        )
        assert answer.status_code == 200
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=15)
        lines = process.stderr.read().splitlines()
        process.stderr.close()
    entries = [json.loads(line) for line in lines if line.strip()]  # every line is JSON
    [access] = [e for e in entries if e["logger"] == "specroute.access"]
    assert access["path"] == "/v1/completions" and access["status"] == 200


def _wait_for_line(caplog: pytest.LogCaptureFixture, text: str) -> logging.LogRecord:
    found = wait_until(
        lambda: [r for r in caplog.records if r.name == "specroute.backends" and text in r.getMessage()],
        timeout=5,
        message=f"a log line with {text!r}",
    )
    return found[0]


@pytest.mark.e2e
def test_backend_state_changes_are_logged_once_each(make_cluster: Any, caplog: pytest.LogCaptureFixture) -> None:
    health = {"interval": 0.05, "unhealthy_after": 2, "healthy_after": 2, "eject_after": 1, "ejection_seconds": 10}
    clock = ManualClock()  # the router's live clock: the ejection ends when the test says so
    with (
        caplog.at_level(logging.INFO, logger="specroute.backends"),
        make_cluster(health=health, live_clock=clock) as cluster,
    ):
        cluster.fast.healthy = False
        down = _wait_for_line(caplog, "backend fast-1 (pool fast) unhealthy: 2 health checks failed")
        assert down.levelno == logging.WARNING
        cluster.fast.healthy = True
        _wait_for_line(caplog, "backend fast-1 (pool fast) healthy: 2 health checks passed")
        # A failing request ejects it (and is retried on the other pool).
        cluster.fast.fail_status, cluster.fast.fail_count = 503, 1
        answer = httpx.post(cluster.base_url + "/completions", json={"model": "test-model", "prompt": "x"})
        assert answer.status_code == 200
        _wait_for_line(caplog, "backend fast-1 (pool fast) ejected for 10 s: 1 requests failed in a row")
        # Its probes pass, but it sits out the ejection time on the router's clock: no return yet.
        probes = cluster.fast.health_checks
        wait_until(lambda: cluster.fast.health_checks >= probes + 3, timeout=5, message="the router probing")
        assert not [r for r in caplog.records if "returned" in r.getMessage()]
        # Back through its health checks once the ejection time is over, logged as a return.
        clock.advance(10)
        back = _wait_for_line(
            caplog, "backend fast-1 (pool fast) returned after ejection (10 s): 2 health checks passed"
        )
        assert back.levelno == logging.INFO
    lines = [r.getMessage() for r in caplog.records if r.name == "specroute.backends"]
    assert len([line for line in lines if "unhealthy" in line]) == 1, lines  # one line per change, not per probe
    assert len([line for line in lines if " healthy:" in line]) == 1, lines
    assert len([line for line in lines if " returned after ejection" in line]) == 1, lines


@pytest.mark.e2e
def test_an_ejected_backend_still_down_when_its_time_is_over_is_logged_once_then_its_return(
    make_cluster: Any, caplog: pytest.LogCaptureFixture
) -> None:
    health = {"interval": 0.05, "unhealthy_after": 2, "healthy_after": 2, "eject_after": 1, "ejection_seconds": 10}
    clock = ManualClock()
    with (
        caplog.at_level(logging.INFO, logger="specroute.backends"),
        make_cluster(health=health, live_clock=clock) as cluster,
    ):
        cluster.fast.fail_status, cluster.fast.fail_count = 503, 1
        assert (
            httpx.post(cluster.base_url + "/completions", json={"model": "test-model", "prompt": "x"}).status_code
            == 200
        )
        _wait_for_line(caplog, "backend fast-1 (pool fast) ejected for 10 s: 1 requests failed in a row")
        cluster.fast.healthy = False  # the engine is down when the ejection time is over
        clock.advance(10)
        still = _wait_for_line(
            caplog, "backend fast-1 (pool fast) still unhealthy after its ejection: 2 health checks failed"
        )
        assert still.levelno == logging.WARNING
        probes = cluster.fast.health_checks
        deadline = time.monotonic() + 5
        while cluster.fast.health_checks < probes + 3:  # more failed probes: no more lines
            assert time.monotonic() < deadline, "the router stopped probing"
            time.sleep(0.01)
        cluster.fast.healthy = True
        _wait_for_line(caplog, "backend fast-1 (pool fast) returned after ejection (10 s): 2 health checks passed")
    lines = [r.getMessage() for r in caplog.records if r.name == "specroute.backends"]
    assert len(lines) == 3, lines
