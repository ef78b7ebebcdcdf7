"""What ships for Prometheus and Grafana (deploy/prometheus, deploy/grafana), checked by promtool
and by a real Prometheus server that scrapes a router under load and runs every dashboard query
and every rule."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from router.app import create_app
from router.config import Settings
from router.demo import prior_speeds
from router.sim.profile import load_profile
from router.sim.server import create_sim_app
from tests.servers import ServerThread

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "specroute.json"
promtool = shutil.which("promtool")
prometheus = shutil.which("prometheus")
needs_promtool = pytest.mark.skipif(promtool is None and not os.environ.get("CI"), reason="promtool not installed")
# Grafana's own variable; Prometheus gets a fixed window in its place (20 one-second scrapes).
RATE_WINDOW = "20s"
# How long Prometheus may take, under load, to show every panel and rule.
SCRAPE_DEADLINE = 120
# An alert's expression: a query compared to a threshold.
ALERT_THRESHOLD = re.compile(r"(?P<query>.+?)\s*(?:==|!=|>=|<=|>|<)\s*[0-9.]+")


def _promtool(*args: str, cwd: Path = PROMETHEUS_DIR) -> None:
    assert promtool is not None, "CI installs Debian's prometheus package for promtool"
    done = subprocess.run([promtool, *args], cwd=cwd, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def _panel_queries() -> list[tuple[str, str]]:
    """(panel title and target, PromQL as Prometheus gets it) for every target of the dashboard:
    a panel with two queries gives two names."""
    board = json.loads(DASHBOARD.read_text())
    return [
        (f"{panel['title']} [{target['refId']}]", target["expr"].replace("$__rate_interval", RATE_WINDOW))
        for panel in board["panels"]
        for target in panel["targets"]
    ]


def _rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load((PROMETHEUS_DIR / "rules.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


@needs_promtool
def test_config_and_rules_pass_promtool() -> None:
    _promtool("check", "config", "prometheus.yml")
    _promtool("check", "rules", "rules.yml")
    _promtool("test", "rules", "rules_test.yml")


def test_every_alert_has_a_unit_test() -> None:
    tests = yaml.safe_load((PROMETHEUS_DIR / "rules_test.yml").read_text())["tests"]
    tested = {case["alertname"] for test in tests for case in test.get("alert_rule_test", []) if case["exp_alerts"]}
    alerts = {rule["alert"] for rule in _rules() if "alert" in rule}
    assert alerts == tested


def test_dashboard_is_what_the_script_writes() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "dashboard.py"), "--check"], capture_output=True)
    assert done.returncode == 0, done.stderr
    board = json.loads(DASHBOARD.read_text())
    assert len({panel["id"] for panel in board["panels"]}) == len(board["panels"])
    assert all(panel["targets"] for panel in board["panels"])


@needs_promtool
def test_every_panel_query_parses(tmp_path: Path) -> None:
    # promtool parses the PromQL of every rule: each query becomes one recording rule.
    rules = [{"record": f"panel:query_{i}", "expr": expr} for i, (_, expr) in enumerate(_panel_queries())]
    path = tmp_path / "panels.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    _promtool("check", "rules", str(path), cwd=tmp_path)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.fixture
def simulated_router() -> Iterator[str]:
    """Simulated engines (10x real time) behind a router whose standard pool is small enough
    that a burst of batch work overflows its queue: every panel and rule then has something to show.

    Each pool has its profile's calibrated speeds as its `prior_speed`, as `specroute serve` gives
    the simulated cluster: the learned-crossover gauge is exported from the start, and what the
    load teaches refines it. Without a prior it waited for a trusted speed on both pools, which a
    starved machine may never give: on a 2-core machine with eight busy processes, 240 s of load
    left 218 answers at each of concurrencies 1-4 on the speculative pool and not one trusted (a
    95 % interval within 10 % of the mean), the speeds measured being mostly when the scheduler
    let the router run."""
    profiles = {name: load_profile(name) for name in ("fast", "team")}
    priors = {name: prior_speeds(profile, time_scale=10) for name, profile in profiles.items()}
    with (
        ServerThread(create_sim_app(profiles["fast"], time_scale=10)) as fast,
        ServerThread(create_sim_app(profiles["team"], time_scale=10)) as team,
    ):
        data: dict[str, Any] = {
            "scrape": {"interval": 0.1, "timeout": 0.5, "stale_after": 1.0},
            "health": {"interval": 0.5},
            "classify": {"burst_hold_seconds": 0},
            "pools": {
                "fast": {
                    "speculative": True,
                    "prior_speed": priors["fast"],
                    "backends": {"fast-1": {"url": fast.url, "max_concurrency": 64}},
                },
                "team": {
                    "speculative": False,
                    "prior_speed": priors["team"],
                    "queue_size": 2,
                    "backends": {"team-1": {"url": team.url, "max_concurrency": 4}},
                },
            },
        }
        settings = Settings(**data)
        with ServerThread(create_app(settings), fast=True) as router:
            yield router.url


def _load(url: str, stop: threading.Event) -> None:
    """Interactive users (more than the crossover, so some spill), a batch burst, a bad body.

    The answers are long (at least `learn.SHORT_ANSWER` tokens, a third of a second at ten times
    real speed): what the router learns of them refines the pools' prior speeds, and the speed
    of a short answer on a starved machine is mostly when the scheduler let it run."""

    def interactive(user: int) -> None:
        body = {
            "model": "glm-5.3-flash",
            "user": f"user-{user}",
            "stream": True,
            "max_tokens": 96,
            "messages": [{"role": "user", "content": "Tell me about tides."}],
        }
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            response.read()

    def batch(_: int) -> None:
        # Streamed, so the standard pool's speed is learned (and the crossover with it) even
        # if no interactive request spills.
        body = {"model": "glm-5.3-flash", "prompt": "Summarise this.", "max_tokens": 64, "stream": True}
        with client.stream("POST", "/v1/completions", json=body, headers={"X-Job-Type": "batch"}) as response:
            response.read()

    with httpx.Client(base_url=url, timeout=60) as client, concurrent.futures.ThreadPoolExecutor(16) as pool:
        while not stop.is_set():
            list(pool.map(interactive, range(8)))
            list(pool.map(batch, range(8)))
            client.post("/v1/chat/completions", content=b"{not json")


@pytest.mark.e2e
@pytest.mark.timeout(SCRAPE_DEADLINE + 120)
@pytest.mark.skipif(prometheus is None and not os.environ.get("CI"), reason="prometheus not installed")
def test_a_real_prometheus_answers_every_panel_and_rule(simulated_router: str) -> None:
    assert prometheus is not None, "CI installs Debian's prometheus package"
    router_port = simulated_router.rsplit(":", 1)[1]
    port = _free_port()
    with tempfile.TemporaryDirectory() as directory:
        work = Path(directory)
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(PROMETHEUS_DIR / "rules.yml")],
            "scrape_configs": [
                {"job_name": "specroute", "static_configs": [{"targets": [f"127.0.0.1:{router_port}"]}]}
            ],
        }
        (work / "prometheus.yml").write_text(yaml.safe_dump(config))
        log = (work / "prometheus.log").open("w")
        server = subprocess.Popen(
            [
                prometheus,
                f"--config.file={work / 'prometheus.yml'}",
                f"--storage.tsdb.path={work / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        stop = threading.Event()
        load = threading.Thread(target=_load, args=(simulated_router, stop), daemon=True)
        load.start()
        try:
            api = f"http://127.0.0.1:{port}/api/v1"
            _check_prometheus(api, server, work / "prometheus.log")
        finally:
            stop.set()
            load.join(timeout=60)
            server.terminate()
            server.wait(timeout=30)
            log.close()


def _alert_queries() -> list[tuple[str, str, str]]:
    """(alert, its expression, what it compares) for every alert: the expression itself answers
    only while the alert fires (its firing is proven by `promtool test rules`); what it compares
    to its threshold must have data under load."""
    alerts = []
    for rule in _rules():
        if "alert" in rule:
            expr = " ".join(rule["expr"].split())
            compared = ALERT_THRESHOLD.fullmatch(expr)
            assert compared is not None, f"{rule['alert']}: not of the form <query> <comparison> <number>: {expr}"
            alerts.append((rule["alert"], expr, compared["query"]))
    return alerts


def _check_prometheus(api: str, server: subprocess.Popen[bytes], log: Path) -> None:
    # The rules' 5-minute windows need two scrapes in them; the dashboard's 20 s windows too.
    records = [(f"record {rule['record']}", rule["record"]) for rule in _rules() if "record" in rule]
    alerts = _alert_queries()
    compared = [(f"alert {name} (what it compares)", query) for name, _, query in alerts]
    panels = [(f"panel {name}", expr) for name, expr in _panel_queries()]
    waiting = dict([*panels, *records, *compared, ("up", 'up{job="specroute"}')])
    assert len(waiting) == len(panels) + len(records) + len(compared) + 1, "two queries under one name"
    deadline = time.monotonic() + SCRAPE_DEADLINE
    with httpx.Client(timeout=10) as client:
        while waiting:
            assert server.poll() is None, log.read_text()
            for name, expr in list(waiting.items()):
                try:
                    answer = client.get(f"{api}/query", params={"query": expr}).json()
                except (httpx.TransportError, ValueError):
                    break  # not up yet (refused, or an empty answer while it starts)
                assert answer["status"] == "success", (name, answer)
                if answer["data"]["result"]:
                    del waiting[name]
            if waiting:
                assert time.monotonic() < deadline, f"no data after {SCRAPE_DEADLINE} s for: {sorted(waiting)}"
                time.sleep(1)
        # Every alert's whole expression runs too (an empty answer is an alert not firing).
        for name, expr, _ in alerts:
            answer = client.get(f"{api}/query", params={"query": expr}).json()
            assert answer["status"] == "success", (name, answer)
        # Every rule, the alerts included, has been evaluated without an error.
        groups = client.get(f"{api}/rules").json()["data"]["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert {r.get("name") for r in rules} == {r.get("alert", r.get("record")) for r in _rules()}
    for rule in rules:
        assert rule["health"] == "ok", rule
