"""Client API keys and who may use the override headers."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.conftest import Cluster

pytestmark = pytest.mark.e2e  # the router served on loopback in front of fake engines

AUTH = {"client_keys_env": "TEST_CLIENT_KEYS", "override_keys_env": "TEST_OVERRIDE_KEYS"}
CHAT = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


@pytest.fixture(autouse=True)
def keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_CLIENT_KEYS", "sk-alice, sk-ops")
    monkeypatch.setenv("TEST_OVERRIDE_KEYS", "sk-ops")


def _post(cluster: Cluster, key: str | None, **headers: str) -> httpx.Response:
    if key:
        headers["authorization"] = f"Bearer {key}"
    return httpx.post(cluster.base_url + "/chat/completions", json=CHAT, headers=headers)


def _nothing_forwarded(cluster: Cluster) -> None:
    assert cluster.fast.requests == [] and cluster.team.requests == []


@pytest.mark.parametrize("key", [None, "sk-mallory", "sk-alice2", "sk-alic"])
def test_without_a_known_key_is_401_and_nothing_is_forwarded(make_cluster: Any, key: str | None) -> None:
    with make_cluster(auth=AUTH) as cluster:
        response = _post(cluster, key)
        assert response.status_code == 401
        error = response.json()["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
        assert set(error) == {"message", "type", "param", "code"}
        _nothing_forwarded(cluster)
        assert httpx.get(cluster.base_url + "/models").status_code == 401


def test_known_keys_are_served_and_the_sdk_sees_401_as_authentication_error(make_cluster: Any) -> None:
    with make_cluster(auth=AUTH) as cluster:
        assert _post(cluster, "sk-alice").status_code == 200
        assert _post(cluster, "sk-ops").status_code == 200
        assert "authorization" not in cluster.fast.requests[-1].headers  # the client's key stays here
        client = cluster.client("wrong")
        with pytest.raises(openai.AuthenticationError):
            client.chat.completions.create(**CHAT)


def test_overrides_from_other_keys_are_ignored(make_cluster: Any) -> None:
    with make_cluster(auth=AUTH) as cluster:
        ignored = _post(cluster, "sk-alice", **{"X-Route-Pool": "team", "X-Job-Type": "batch"})
        assert ignored.status_code == 200
        assert ignored.headers["x-route-pool"] == "fast"
        assert ignored.headers["x-route-reason"] == "default"
        assert "x-route-pool" not in cluster.fast.requests[-1].headers
        honoured = _post(cluster, "sk-ops", **{"X-Route-Pool": "team"})
        assert honoured.headers["x-route-pool"] == "team"
        assert honoured.headers["x-route-reason"] == "pinned"


def test_overrides_from_other_keys_can_be_rejected(make_cluster: Any) -> None:
    with make_cluster(auth={**AUTH, "untrusted_overrides": "reject"}) as cluster:
        response = _post(cluster, "sk-alice", **{"X-Job-Type": "batch"})
        assert response.status_code == 403
        error = response.json()["error"]
        assert error["code"] == "override_denied" and error["param"] == "x-job-type"
        _nothing_forwarded(cluster)


def test_no_keys_configured_means_open(cluster: Cluster) -> None:
    assert _post(cluster, None).status_code == 200
    assert _post(cluster, None, **{"X-Route-Pool": "team"}).headers["x-route-pool"] == "team"
