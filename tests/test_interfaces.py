"""docs/interfaces.md against the code: every endpoint the router serves, every error `code` it
answers and every header it adds to an answer is on that page."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from starlette.routing import Mount, Route

from router.app import create_app
from router.config import Settings
from tests.fake_engine import FakeEngine
from tests.servers import ServerThread, serve

ROOT = Path(__file__).resolve().parent.parent
PAGE = (ROOT / "docs" / "interfaces.md").read_text()
POOLS: dict[str, Any] = {
    "fast": {"speculative": True, "backends": {"fast-1": {"url": "http://127.0.0.1:9"}}},
    "team": {"speculative": False, "backends": {"team-1": {"url": "http://127.0.0.1:9"}}},
}


def _paths(routes: list[object], prefix: str = "") -> set[str]:
    paths: set[str] = set()
    for route in routes:
        if isinstance(route, Mount):
            paths |= _paths(list(route.routes), prefix + route.path)
        elif isinstance(route, Route):
            paths.add(prefix + route.path)
    return paths


def _shape(path: str) -> str:
    """`/v1/files/{file_id}` and `/v1/files/{id}` alike: parameters by place, not name."""
    return re.sub(r"\{[^}]*\}", "{}", path)


def test_every_endpoint_is_documented() -> None:
    app = create_app(Settings.model_validate({"pools": POOLS}))
    documented = {_shape(path) for path in re.findall(r"`(?:[A-Z]+ )?(/[^` ]*)`", PAGE)}
    served = {_shape(path) for path in _paths(list(app.routes))} - {"/v1/{}"}  # the catch-all: "any other"
    assert served - documented == set()
    assert "any other `POST /v1/*`" in PAGE


def test_every_error_code_is_documented() -> None:
    sources = [p for p in (ROOT / "router").rglob("*.py") if not {"sim", "bench"} & set(p.parts)]
    codes = {code for path in sources for code in re.findall(r'\bcode="([a-z_]+)"', path.read_text())}
    assert len(codes) > 30  # the pattern still finds how errors are made
    errors = PAGE.split("## Errors", 1)[1].split("\n## ", 1)[0]
    assert {code for code in codes if f"`{code}`" not in errors} == set()


@pytest.mark.e2e
def test_every_header_the_router_adds_is_documented(tmp_path: Path) -> None:
    engine = FakeEngine(metrics="vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n")
    with ServerThread(engine.app()) as upstream:
        pools = {
            name: {**pool, "backends": {b: {"url": upstream.url} for b in pool["backends"]}}
            for name, pool in POOLS.items()
        }
        config = tmp_path / "router.yaml"
        config.write_text(yaml.safe_dump({"pools": pools}))
        with serve(config) as (_, url):
            body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}]}
            direct = httpx.post(upstream.url + "/v1/chat/completions", json=body, timeout=10)
            routed = httpx.post(url + "/v1/chat/completions", json=body, timeout=10)
    assert direct.status_code == routed.status_code == 200
    added = {name for name in routed.headers if name not in direct.headers}
    added -= {"date", "server", "content-length", "transfer-encoding", "connection", "keep-alive"}  # HTTP's own
    assert added >= {"x-route-pool", "x-route-backend", "x-job-type", "x-route-reason", "x-request-id"}
    headers = PAGE.split("## Headers", 1)[1].split("\n## ", 1)[0].lower()
    assert {name for name in added if f"`{name}`" not in headers} == set()
