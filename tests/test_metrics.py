"""The exposition at /metrics, checked by Prometheus's own promtool."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import subprocess
from typing import Any

import httpx
import pytest

from tests.conftest import Cluster
from tests.wait import wait_until

pytestmark = pytest.mark.e2e  # the router served on loopback in front of fake engines

promtool = shutil.which("promtool")
INTERACTIVE = {"pool": "fast", "backend": "fast-1", "job_class": "interactive"}


@pytest.mark.skipif(promtool is None and not os.environ.get("CI"), reason="promtool not installed")
def test_exposition_passes_promtool(cluster: Cluster) -> None:
    assert promtool is not None, "CI installs Debian's prometheus package for promtool"
    client = cluster.client("k")
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


def _series(cluster: Cluster, name: str) -> list[dict[str, str]]:
    return [s.labels for family in cluster.registry.collect() for s in family.samples if s.name == name]


def test_no_label_is_one_prometheus_sets_itself(cluster: Cluster) -> None:
    cluster.client("k", max_retries=2).completions.create(model="test-model", prompt="x")
    cluster.settled_metric("specroute_request_duration_seconds_count", 1, **INTERACTIVE, model="test-model")
    labels = {label for family in cluster.registry.collect() for s in family.samples for label in s.labels}
    assert "job_class" in labels
    assert not labels & {"job", "instance"}


def test_a_whole_answer_gets_a_duration_and_labels(cluster: Cluster) -> None:
    client = cluster.client("k")
    client.completions.create(model="test-model", prompt="x", max_tokens=4, extra_headers={"X-Job-Type": "batch"})
    labels = {"pool": "team", "backend": "team-1", "job_class": "batch", "model": "test-model"}
    assert cluster.settled_metric("specroute_request_duration_seconds_count", 1, **labels) == 1
    assert cluster.metric("specroute_request_duration_seconds_sum", **labels) > 0
    assert cluster.metric("specroute_requests_total", **labels, status="200", code="") == 1
    assert cluster.metric("specroute_prompt_tokens_total", pool="team", backend="team-1", model="test-model") == 5


def test_model_label_is_bounded_whatever_clients_send(cluster: Cluster) -> None:
    # A hostile client names hundreds of models: they are all `other`, the series count stays put.
    with httpx.Client(base_url=cluster.base_url) as client:
        for i in range(200):
            client.post("/completions", json={"model": f"probe-{i}\n{{x}}", "prompt": "x"})
        client.post("/completions", json={"prompt": "no model"})
        client.post("/completions", json={"model": ["not", "a", "string"], "prompt": "x"})
        assert client.post("/completions", json={"model": "test-model", "prompt": "x"}).status_code == 200
    duration = "specroute_request_duration_seconds_count"
    assert cluster.settled_metric(duration, 200, **INTERACTIVE, model="other") == 200
    assert cluster.settled_metric(duration, 1, **INTERACTIVE, model="test-model") == 1
    models = {labels["model"] for labels in _series(cluster, "specroute_requests_total")}
    assert models == {"other", "none", "test-model"}  # "none": no model named, or not as a string
    assert cluster.metric("specroute_in_flight_requests", pool="fast", backend="fast-1") == 0


def test_configured_model_names_are_labels(make_cluster: Any) -> None:
    with make_cluster(metrics={"models": ["alias-model"]}) as cluster:
        httpx.post(cluster.base_url + "/completions", json={"model": "alias-model", "prompt": "x"})
        assert (
            cluster.settled_metric(
                "specroute_requests_total",
                1,
                pool="fast",
                backend="fast-1",
                job_class="interactive",
                model="alias-model",
                status="404",  # the fake engine serves test-model only; the label is still the name
                code="",
            )
            == 1
        )


def test_router_errors_carry_their_code(make_cluster: Any) -> None:
    with (
        make_cluster(pools={"fast": {"queue_size": 0, "backends": {"fast-1": {"max_concurrency": 1}}}}) as cluster,
        httpx.Client(base_url=cluster.base_url, timeout=10) as client,
    ):
        cluster.fast.first_token_delay = 0.5
        bad = client.post("/completions", content=b"{bad")
        assert bad.status_code == 400
        unrouted = {"pool": "", "backend": "", "job_class": "", "model": "none"}
        assert cluster.settled_metric("specroute_requests_total", 1, **unrouted, status="400", code="invalid_json") == 1
        with concurrent.futures.ThreadPoolExecutor(2) as executor:
            slow = executor.submit(client.post, "/completions", json={"model": "test-model", "prompt": "x"})
            wait_until(
                lambda: cluster.metric("specroute_in_flight_requests", pool="fast", backend="fast-1") >= 1,
                timeout=5,
                interval=0.005,
                message="the first request at the engine",
            )
            full = client.post(
                "/completions", json={"model": "test-model", "prompt": "x"}, headers={"X-Route-Pool": "fast"}
            )
            assert slow.result().status_code == 200
        assert full.status_code == 503
        assert full.json()["error"]["code"] == "queue_full"
        queued = {"pool": "fast", "backend": "", "job_class": "interactive", "model": "test-model"}
        assert cluster.settled_metric("specroute_requests_total", 1, **queued, status="503", code="queue_full") == 1
        assert cluster.settled_metric("specroute_in_flight_requests", 0, pool="fast", backend="fast-1") == 0
        assert cluster.metric("specroute_queued_requests", pool="fast", job_class="interactive") == 0
        assert client.post("/completions", json={"model": "test-model", "prompt": "x"}).status_code == 200


def test_process_and_build_collectors(cluster: Cluster) -> None:
    text = httpx.get(cluster.router.url + "/metrics").text
    for name in ("process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds", "python_info"):
        assert f"\n{name}" in text, name
    version = httpx.get(cluster.router.url + "/version").json()
    build = {"version": version["version"], "commit": version["commit"] or "", "python": version["python"]}
    assert cluster.metric("specroute_build_info", **build) == 1
