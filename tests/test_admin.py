"""The admin API over real sockets: who may use it, draining and resuming, reloading.

Each test's name states what must hold for it to pass.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.conftest import Cluster

pytestmark = pytest.mark.e2e  # the router served on loopback in front of fake engines

ADMIN_ENV, ADMIN_KEY = "SPECROUTE_TEST_ADMIN_KEY", "admin-secret"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
CHAT = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture
def admin_key(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.setenv(ADMIN_ENV, ADMIN_KEY)
    return {"auth": {"admin_key_env": ADMIN_ENV}}


def _admin(cluster: Cluster, action: str, body: Any, headers: dict[str, str] = ADMIN) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{cluster.router.url}/admin/{action}", content=content, headers=headers, timeout=5)


def _status(cluster: Cluster) -> dict[str, Any]:
    status: dict[str, Any] = httpx.get(cluster.router.url + "/router/status").json()
    return status


def _draining(cluster: Cluster) -> dict[str, bool]:
    pools = _status(cluster)["pools"].values()
    return {name: b["draining"] for pool in pools for name, b in pool["backends"].items()}


def _chat(cluster: Cluster, **headers: str) -> httpx.Response:
    return httpx.post(cluster.base_url + "/chat/completions", json=CHAT, headers=headers, timeout=10)


class Stream:
    """A streaming request read in a thread; its headers are there once `started` is set."""

    def __init__(self, cluster: Cluster, max_tokens: int, **headers: str) -> None:
        self.headers: dict[str, str] = {}
        self.events: list[str] = []
        self.started = threading.Event()
        body = {**CHAT, "max_tokens": max_tokens, "stream": True}
        self._thread = threading.Thread(target=self._read, args=(cluster.base_url, body, headers))
        self._thread.start()
        assert self.started.wait(5)

    def _read(self, base_url: str, body: dict[str, Any], headers: dict[str, str]) -> None:
        with httpx.stream("POST", base_url + "/chat/completions", json=body, headers=headers, timeout=30) as response:
            self.headers = dict(response.headers)
            self.started.set()
            lines = response.iter_lines()  # kept: dropping the iterator would close the connection
            self.events = [line[6:] for line in lines if line.startswith("data: ")]

    def finish(self) -> list[str]:
        self._thread.join(30)
        return self.events


def _tokens(events: list[str]) -> list[str]:
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    return [delta["content"] for delta in deltas if delta.get("content")]


@pytest.fixture
def slow_cluster(make_cluster: Any, admin_key: dict[str, Any]) -> Iterator[Cluster]:
    with make_cluster(fast_backends=2, **admin_key) as cluster:
        for engine in (cluster.fast, *cluster.more_fast, cluster.team):
            engine.token_delay = 0.05
        yield cluster


def test_admin_api_is_off_without_an_admin_key_configured_403(cluster: Cluster) -> None:
    for action in ("drain", "resume", "reload"):
        response = _admin(cluster, action, {"pool": "fast"})
        assert response.status_code == 403
        assert response.json()["error"]["code"] == "admin_disabled"
    assert not any(_draining(cluster).values())


def test_admin_routes_answer_401_without_the_admin_key_and_a_client_key_is_not_one(
    make_cluster: Any, admin_key: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECROUTE_TEST_CLIENT_KEYS", "client-key")
    with make_cluster(auth={**admin_key["auth"], "client_keys_env": "SPECROUTE_TEST_CLIENT_KEYS"}) as cluster:
        for headers in ({}, {"authorization": "Bearer client-key"}, {"authorization": "Bearer admin-secreT"}):
            for action in ("drain", "resume", "reload"):
                response = _admin(cluster, action, {"pool": "fast"}, headers)
                assert response.status_code == 401, (headers, action)
                error = response.json()["error"]
                assert error["code"] == "invalid_admin_key" and error["type"] == "invalid_request_error"
        assert not any(_draining(cluster).values())
        assert cluster.metric("specroute_config_reloads_total", result="applied") == 0


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"{not json", 400, "invalid_json"),
        ({}, 400, "invalid_target"),
        (["fast"], 400, "invalid_target"),
        ({"pool": "fast", "backend": "fast-1"}, 400, "invalid_target"),
        ({"pool": 3}, 400, "invalid_target"),
        ({"cluster": "fast"}, 400, "invalid_target"),
        ({"pool": "nope"}, 404, "unknown_pool"),
        ({"backend": "nope"}, 404, "unknown_backend"),
    ],
)
def test_a_bad_drain_request_gets_a_4xx_and_drains_nothing(
    make_cluster: Any, admin_key: dict[str, Any], body: Any, status: int, code: str
) -> None:
    with make_cluster(**admin_key) as cluster:
        response = _admin(cluster, "drain", body)
        assert response.status_code == status
        assert response.json()["error"]["code"] == code
        assert not any(_draining(cluster).values())


def test_a_drained_backend_takes_no_new_work_and_its_running_stream_finishes(slow_cluster: Cluster) -> None:
    cluster = slow_cluster
    running = Stream(cluster, 30, **{"X-Route-Pool": "fast"})
    drained = running.headers["x-route-backend"]
    answer = _admin(cluster, "drain", {"backend": drained}).json()
    assert answer["backends"] == [{"pool": "fast", "backend": drained, "draining": True, "in_flight": 1}]
    assert cluster.metric("specroute_backend_draining", pool="fast", backend=drained) == 1
    others = {_chat(cluster, **{"X-Route-Pool": "fast"}).headers["x-route-backend"] for _ in range(4)}
    assert drained not in others and others
    events = running.finish()
    assert len(_tokens(events)) == 30 and events[-1] == "[DONE]"  # the running stream was not cut
    assert cluster.settled_metric("specroute_in_flight_requests", 0, pool="fast", backend=drained) == 0

    assert _admin(cluster, "resume", {"backend": drained}).json()["backends"][0]["draining"] is False
    seen = {_chat(cluster, **{"X-Route-Pool": "fast"}).headers["x-route-backend"] for _ in range(2)}
    assert drained in seen  # idle backends tie, and the first configured wins: it is back


@pytest.mark.parametrize("mode", ["static", "adaptive"])
def test_draining_the_speculative_pool_moves_interactive_work_to_the_standard_pool(
    make_cluster: Any, admin_key: dict[str, Any], mode: str
) -> None:
    with make_cluster(routing={"mode": mode}, **admin_key) as cluster:
        answer = _admin(cluster, "drain", {"pool": "fast"}).json()
        assert [b["backend"] for b in answer["backends"]] == ["fast-1"]
        response = _chat(cluster)
        assert response.status_code == 200
        assert response.headers["x-route-pool"] == "team"
        assert response.headers["x-route-reason"] == "spill:spec-draining"
        pinned = _chat(cluster, **{"X-Route-Pool": "fast"})
        assert pinned.status_code == 503 and pinned.json()["error"]["code"] == "pool_unavailable"
        assert pinned.headers["retry-after"]
        assert cluster.fast.requests == []  # nothing reached the drained engine
        assert httpx.get(cluster.router.url + "/readyz").status_code == 200  # the router still serves

        _admin(cluster, "resume", {"pool": "fast"})
        assert _chat(cluster).headers["x-route-pool"] == "fast"


def _write(path: Path, data: dict[str, Any]) -> None:
    path.write_text(yaml.safe_dump(data))


def test_reload_applies_a_valid_file_and_the_running_stream_goes_on(
    make_cluster: Any, admin_key: dict[str, Any], tmp_path: Path
) -> None:
    config = tmp_path / "router.yaml"
    with make_cluster(fast_backends=2, config_file=config, **admin_key) as cluster:
        for engine in (cluster.fast, *cluster.more_fast):
            engine.token_delay = 0.05
        first = Stream(cluster, 30, **{"X-Route-Pool": "fast"})
        second = Stream(cluster, 30, **{"X-Route-Pool": "fast"})
        on = {first.headers["x-route-backend"], second.headers["x-route-backend"]}
        assert on == {"fast-1", "fast-2"}

        data = json.loads(json.dumps(cluster.config))
        data["routing"] = {"mode": "static"}
        data["listen"] = {"port": 9}  # the socket is bound: a restart's job
        data["pools"]["fast"]["backends"]["fast-1"]["max_concurrency"] = 2
        del data["pools"]["fast"]["backends"]["fast-2"]  # removed while a stream runs on it
        data["pools"]["team"]["backends"]["team-2"] = {"url": data["pools"]["team"]["backends"]["team-1"]["url"]}
        _write(config, data)
        answer = _admin(cluster, "reload", b"")
        assert answer.status_code == 200, answer.text
        assert answer.json() == {
            "reloaded": True,
            "changed": [
                "listen.port",
                "pools.fast.backends.fast-1.max_concurrency",
                "pools.fast.backends.fast-2",
                "pools.team.backends.team-2",
                "routing.mode",
            ],
            "needs_restart": ["listen.port"],
        }
        status = _status(cluster)
        assert status["routing"]["mode"] == "static"
        fast_1 = status["pools"]["fast"]["backends"]["fast-1"]
        assert fast_1["max_concurrency"] == 2 and fast_1["in_flight"] == 1  # the same backend, kept
        assert list(status["pools"]["fast"]["backends"]) == ["fast-1"]
        assert list(status["pools"]["team"]["backends"]) == ["team-1", "team-2"]

        for stream in (first, second):
            events = stream.finish()
            assert len(_tokens(events)) == 30 and events[-1] == "[DONE]"
        assert _chat(cluster, **{"X-Route-Pool": "fast"}).headers["x-route-backend"] == "fast-1"
        assert cluster.settled_metric("specroute_in_flight_requests", 0, pool="fast", backend="fast-1") == 0
        assert cluster.metric("specroute_config_reloads_total", result="applied") == 1


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("pools: {fast: {speculative: maybe, backends: {}}}\n", "pools.fast"),
        ("pools: [unclosed\n", "not valid YAML"),
        ("- a list\n", "top level"),
    ],
)
def test_reload_rejects_an_invalid_file_with_400_and_keeps_the_running_settings(
    make_cluster: Any, admin_key: dict[str, Any], tmp_path: Path, text: str, named: str
) -> None:
    config = tmp_path / "router.yaml"
    with make_cluster(config_file=config, **admin_key) as cluster:
        before = _status(cluster)
        config.write_text(text)
        answer = _admin(cluster, "reload", b"")
        assert answer.status_code == 400
        error = answer.json()["error"]
        assert error["code"] == "invalid_config" and named in error["message"]
        assert _status(cluster)["pools"].keys() == before["pools"].keys()
        assert _chat(cluster).status_code == 200  # still routing on the old settings
        assert cluster.metric("specroute_config_reloads_total", result="invalid") == 1


def test_reload_of_a_router_started_without_a_file_is_409(make_cluster: Any, admin_key: dict[str, Any]) -> None:
    with make_cluster(**admin_key) as cluster:
        answer = _admin(cluster, "reload", b"")
        assert answer.status_code == 409
        assert answer.json()["error"]["code"] == "nothing_to_reload"


def test_reload_names_the_client_limits_as_needing_a_restart(
    make_cluster: Any, admin_key: dict[str, Any], tmp_path: Path
) -> None:
    """The client limits hold each connection from when it was accepted (router/listener.py);
    the JSON depth is read per request, so it takes effect at once."""
    config = tmp_path / "router.yaml"
    with make_cluster(config_file=config, **admin_key) as cluster:
        data = json.loads(json.dumps(cluster.config))
        data["listen"] = {"forwarded_allow_ips": ["10.0.0.1"]}
        data["timeouts"] = {"request_head": 3, "keep_alive": 2, "client_write": 4}
        data["limits"] = {"request_head_bytes": 4096, "request_headers": 20, "max_connections": 10, "json_depth": 2}
        _write(config, data)
        answer = _admin(cluster, "reload", b"")
        assert answer.status_code == 200, answer.text
        restart = [
            "limits.max_connections",
            "limits.request_head_bytes",
            "limits.request_headers",
            "listen.forwarded_allow_ips",
            "timeouts.client_write",
            "timeouts.keep_alive",
            "timeouts.request_head",
        ]
        assert answer.json() == {"reloaded": True, "changed": ["limits.json_depth", *restart], "needs_restart": restart}
        deep = {**CHAT, "metadata": {"a": {"b": "c"}}}  # three levels: past the new depth of 2
        assert httpx.post(cluster.base_url + "/chat/completions", json=deep).json()["error"]["code"] == "invalid_json"


def _state_lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "specroute.backends"]


def test_drain_and_resume_are_logged_once_with_backend_pool_and_who_asked(
    make_cluster: Any, admin_key: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="specroute.backends")
    with make_cluster(fast_backends=2, **admin_key) as cluster:
        assert _admin(cluster, "drain", {"backend": "fast-2"}).status_code == 200
        assert _state_lines(caplog) == [
            (logging.INFO, "backend fast-2 (pool fast) drained: asked through the admin API (backend fast-2)")
        ]
        caplog.clear()
        # The pool: only fast-1 changes; fast-2, drained already, logs nothing.
        assert _admin(cluster, "drain", {"pool": "fast"}).status_code == 200
        assert _admin(cluster, "drain", {"backend": "fast-1"}).status_code == 200  # nothing changes
        assert _state_lines(caplog) == [
            (logging.INFO, "backend fast-1 (pool fast) drained: asked through the admin API (pool fast)")
        ]
        caplog.clear()
        assert _admin(cluster, "resume", {"backend": "fast-1"}).status_code == 200
        assert _admin(cluster, "resume", {"backend": "fast-1"}).status_code == 200  # nothing changes
        assert _admin(cluster, "resume", {"pool": "team"}).status_code == 200  # nothing was drained
        assert _state_lines(caplog) == [
            (logging.INFO, "backend fast-1 (pool fast) resumed: asked through the admin API (backend fast-1)")
        ]


def test_a_drained_backend_configured_anew_by_a_reload_is_logged_as_resumed(
    make_cluster: Any, admin_key: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="specroute.backends")
    config = tmp_path / "router.yaml"
    with make_cluster(fast_backends=2, config_file=config, **admin_key) as cluster:
        _admin(cluster, "drain", {"pool": "fast"})
        caplog.clear()
        data = json.loads(json.dumps(cluster.config))
        backends = data["pools"]["fast"]["backends"]
        backends["fast-2"]["url"] = backends["fast-1"]["url"]  # fast-2 at another URL: a new backend
        _write(config, data)
        assert _admin(cluster, "reload", b"").status_code == 200
        assert _draining(cluster) == {"fast-1": True, "fast-2": False, "team-1": False}
        assert _state_lines(caplog) == [
            (
                logging.INFO,
                "backend fast-2 (pool fast) resumed: a reload configured it anew (another URL or pool),"
                " the drain is not kept",
            )
        ]
