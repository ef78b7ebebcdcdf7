"""The router's own endpoints besides the API: /health, /healthz, /version."""

from __future__ import annotations

import platform
import re

import httpx
import pytest

from tests.conftest import Cluster

pytestmark = pytest.mark.e2e  # the router served on loopback in front of fake engines


def test_health_is_healthz_for_load_tools(cluster: Cluster) -> None:
    # guidellm (and others) probe vLLM's and SGLang's path first and stop on a 404.
    for path in ("/health", "/healthz"):
        response = httpx.get(cluster.router.url + path)
        assert response.status_code == 200
        assert response.json() == {"status": "ok"}
    assert httpx.post(cluster.router.url + "/health").status_code == 405


def test_version(cluster: Cluster) -> None:
    body = httpx.get(cluster.router.url + "/version").json()
    assert set(body) == {"version", "commit", "python"}
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", body["version"])
    assert body["python"] == platform.python_version()
    assert body["commit"] is None or re.fullmatch(r"[0-9a-f]{7,40}", body["commit"])
