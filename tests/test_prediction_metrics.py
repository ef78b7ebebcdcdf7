"""Prediction accounting (router.request.observe): the first token each decision predicted, set
against the one that came, and the share of interactive streams within routing.ttft_target."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import pytest
from openai import APIError, OpenAI

from tests.conftest import Cluster

pytestmark = pytest.mark.e2e


def _stream(client: OpenAI, user: str) -> None:
    for _ in client.chat.completions.create(
        model="test-model", messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=2, user=user
    ):
        pass


def _error_buckets(cluster: Cluster) -> dict[float, float]:
    name = "specroute_ttft_prediction_error_seconds_bucket"
    return {
        float(sample.labels["le"]): sample.value
        for metric in cluster.registry.collect()
        for sample in metric.samples
        if sample.name == name and sample.labels["pool"] == "fast"
    }


def test_the_predicted_first_token_is_set_against_the_actual_one(
    make_cluster: Callable[..., AbstractContextManager[Cluster]],
) -> None:
    with make_cluster(routing={"ttft_target": 0.15, "mode": "static"}) as cluster:
        cluster.fast.first_token_delay = 0.3
        with OpenAI(base_url=cluster.base_url, api_key="x", max_retries=0) as client:
            # The first stream: nothing measured, the idle engine predicted at once (0 s); 0.3 s late.
            _stream(client, "a")
            first = _error_buckets(cluster)
            assert first[0.25] == 0 and first[float("inf")] == 1
            # The next ones: predicted from the first tokens measured (their median), within a quarter second.
            for user in ("b", "c", "d"):
                _stream(client, user)
            buckets = _error_buckets(cluster)
            assert buckets[float("inf")] == 4
            assert buckets[0.25] - buckets[-0.25] == 3
            late = cluster.settled_metric("specroute_interactive_ttft_target_total", 4, pool="fast", result="late")
            assert late == 4
            assert cluster.metric("specroute_interactive_ttft_target_total", pool="fast", result="within") == 0
            # Within the target once the engine is quick; a stream that fails before its first token is none.
            cluster.fast.first_token_delay = 0.0
            _stream(client, "e")
            assert cluster.metric("specroute_interactive_ttft_target_total", pool="fast", result="within") == 1
            cluster.fast.fail_status, cluster.fast.fail_count = 500, 1
            with pytest.raises(APIError):
                _stream(client, "f")
            none = cluster.settled_metric("specroute_interactive_ttft_target_total", 1, pool="fast", result="none")
            assert none == 1
