"""The exposition at /metrics, checked by Prometheus's own promtool."""

from __future__ import annotations

import os
import shutil
import subprocess

import httpx
import openai
import pytest

from tests.conftest import Cluster

promtool = shutil.which("promtool")


@pytest.mark.skipif(promtool is None and not os.environ.get("CI"), reason="promtool not installed")
def test_exposition_passes_promtool(cluster: Cluster) -> None:
    assert promtool is not None, "CI installs Debian's prometheus package for promtool"
    client = openai.OpenAI(base_url=cluster.base_url, api_key="k", max_retries=0)
    for _chunk in client.chat.completions.create(
        model="test-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
    ):
        pass
    httpx.post(cluster.base_url + "/completions", content=b"{bad")
    assert (
        cluster.settled_metric(
            "specroute_completion_tokens_total", 3, pool="fast", backend="fast-1", model="test-model"
        )
        == 3
    )
    response = httpx.get(cluster.router.url + "/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    for name in (
        "specroute_requests_total",
        "specroute_time_to_first_token_seconds_bucket",
        "specroute_time_per_output_token_seconds_bucket",
        "specroute_in_flight_requests",
        "specroute_queued_requests",
        "specroute_completion_tokens_total",
        "specroute_route_decisions_total",
        "specroute_backend_healthy",
    ):
        assert name in text, name
    checked = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
