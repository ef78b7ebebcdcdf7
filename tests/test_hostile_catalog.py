"""A hostile engine's `/v1/models`: new names at every ask. The names the router remembers (the
values the metrics' `model` label may take) stay bounded; the clients' list is the engine's."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import running_cluster

pytestmark = pytest.mark.e2e  # the router served on loopback in front of fake engines

BOUND = 1_000  # router.catalog.ModelCatalog.MAX_KNOWN


def _models(first: int, count: int) -> dict[str, object]:
    return {"object": "list", "data": [{"id": f"m-{n}", "object": "model"} for n in range(first, first + count)]}


def test_an_engine_answering_new_model_names_each_time_is_bounded() -> None:
    with running_cluster(models_cache_seconds=0) as cluster:
        router = cluster.app.state.router
        for ask in range(4):
            cluster.fast.models_answer = _models(ask * 600, 600)
            listed = httpx.get(cluster.base_url + "/models", timeout=30).json()["data"]
            assert {m["id"] for m in listed} >= {f"m-{ask * 600}", f"m-{ask * 600 + 599}"}
            assert len(router.catalog.known) <= BOUND
        assert len(router.catalog.known) == BOUND
        # A name past the bound is still served by its engine and listed; its label is `other`.
        found = httpx.get(cluster.base_url + "/models/m-2399", timeout=30)
        assert found.status_code == 200 and found.json()["id"] == "m-2399"
        assert router.metrics.model("m-2399") == "other"
