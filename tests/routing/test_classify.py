"""Classification as a pure function: tables of request facts -> job class and reason."""

from __future__ import annotations

from typing import Any

import pytest

from router.config import Classify
from router.routing.classify import Classification, Classifier, RequestFacts, UnknownOverride
from router.routing.clients import client_id, key_hash

RULES = [
    {"name": "etl-key", "job": "batch", "match": {"api_key": "etl-secret"}},
    {"name": "nightly", "job": "batch", "match": {"headers": {"X-Team": "data-*"}}},
    {"name": "curl", "job": "batch", "match": {"user_agent": "curl/*"}},
    {"name": "alias", "job": "batch", "match": {"model": "*-batch"}, "rewrite_model": "glm"},
    {"name": "eval-user", "job": "batch", "match": {"user": "eval-*"}},
    {"name": "meta", "job": "batch", "match": {"metadata": {"kind": "backfill"}}},
    {"name": "ide", "job": "interactive", "match": {"headers": {"X-Client": "ide"}, "model": "glm"}},
]


def _classifier(**config: Any) -> Classifier:
    return Classifier(
        Classify(**{"rules": RULES, **config}),
        pool_header="X-Route-Pool",
        job_header="X-Job-Type",
        pools=frozenset({"fast", "team"}),
    )


@pytest.mark.parametrize(
    ("facts", "expected"),
    [
        (RequestFacts(headers={}), Classification("interactive", "default")),
        (RequestFacts(headers={"x-job-type": "batch"}), Classification("batch", "header")),
        (RequestFacts(headers={"x-job-type": "interactive"}, n=4), Classification("interactive", "header")),
        (RequestFacts(headers={"x-route-pool": "team"}), Classification("interactive", "default", "team")),
        (
            RequestFacts(headers={"x-route-pool": "fast", "x-job-type": "batch"}),
            Classification("batch", "header", "fast"),
        ),
        # The header outranks a rule that would say otherwise.
        (
            RequestFacts(headers={"x-job-type": "interactive"}, api_key="etl-secret"),
            Classification("interactive", "header"),
        ),
        (RequestFacts(headers={}, api_key="etl-secret"), Classification("batch", "rule:etl-key")),
        (RequestFacts(headers={}, api_key="etl-secret-2"), Classification("interactive", "default")),
        (RequestFacts(headers={"x-team": "data-eng"}), Classification("batch", "rule:nightly")),
        (RequestFacts(headers={"x-team": "web"}), Classification("interactive", "default")),
        (RequestFacts(headers={"user-agent": "curl/8.5"}), Classification("batch", "rule:curl")),
        (RequestFacts(headers={}, model="glm-batch"), Classification("batch", "rule:alias", None, "glm")),
        (RequestFacts(headers={}, user="eval-7"), Classification("batch", "rule:eval-user")),
        (RequestFacts(headers={}, metadata={"kind": "backfill"}), Classification("batch", "rule:meta")),
        (RequestFacts(headers={}, metadata={"kind": 3}), Classification("interactive", "default")),
        # Every field of a rule must match; the first matching rule wins, before heuristics.
        (RequestFacts(headers={"x-client": "ide"}, model="other"), Classification("interactive", "default")),
        (
            RequestFacts(headers={"x-client": "ide"}, model="glm", client_load=10),
            Classification("interactive", "rule:ide"),
        ),
        (RequestFacts(headers={}, n=2), Classification("batch", "n>1")),
        (RequestFacts(headers={}, client_load=3), Classification("interactive", "default")),
        (RequestFacts(headers={}, client_load=4), Classification("batch", "client-in-flight")),
    ],
)
def test_classification_table(facts: RequestFacts, expected: Classification) -> None:
    assert _classifier().classify(facts) == expected


@pytest.mark.parametrize(
    ("headers", "code"),
    [
        ({"x-route-pool": "gpu9"}, "unknown_pool"),
        ({"x-route-pool": ""}, "unknown_pool"),
        ({"x-job-type": "urgent"}, "unknown_job_type"),
        ({"x-job-type": "Batch"}, "unknown_job_type"),
    ],
)
def test_bad_override_headers_are_rejected(headers: dict[str, str], code: str) -> None:
    with pytest.raises(UnknownOverride) as caught:
        _classifier().classify(RequestFacts(headers=headers))
    assert caught.value.code == code


def test_threshold_is_configurable() -> None:
    classifier = _classifier(batch_inflight_threshold=1)
    assert classifier.classify(RequestFacts(headers={}, client_load=1)).job == "batch"


@pytest.mark.parametrize(
    ("key", "user", "address", "expected"),
    [
        # Everything present counts: a key shared by a team, a `user` shared across machines
        # and one address in front of everyone each tell users apart only together.
        ("k1", "alice", "10.0.0.1", f"key:{key_hash('k1')} user:{key_hash('alice')} addr:10.0.0.1"),
        ("k1", None, "10.0.0.1", f"key:{key_hash('k1')} addr:10.0.0.1"),
        (None, "alice", "10.0.0.1", f"user:{key_hash('alice')} addr:10.0.0.1"),
        (None, None, "10.0.0.1", "addr:10.0.0.1"),
        (None, None, None, "addr:unknown"),
    ],
)
def test_client_identity(key: str | None, user: str | None, address: str | None, expected: str) -> None:
    assert client_id(key, user, address) == expected
