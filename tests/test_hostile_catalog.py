"""A hostile engine's `/v1/models`: new names at every ask. The names the router remembers (the
values the metrics' `model` label may take) stay bounded; the clients' list is the engine's."""

from __future__ import annotations

import tempfile

import httpx
import pytest
from prometheus_client import CollectorRegistry

from router.app import create_app
from router.config import Settings
from tests.conftest import running_cluster, settings_data
from tests.fake_engine import FakeEngine
from tests.servers import ServerThread

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


NESTED = b'{"data": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"  # past Python's JSON parser


def test_an_engine_listing_models_nested_past_the_json_parser_lists_none() -> None:
    # The parser raises RecursionError some 1,000 levels deep: it failed every client's
    # `/v1/models` with a 500, and ended the background refresh of the names for good.
    with running_cluster(models_cache_seconds=0) as cluster:
        cluster.fast.models_answer = NESTED
        listed = httpx.get(cluster.base_url + "/models", timeout=30)
        assert listed.status_code == 200, listed.text
        assert [m["id"] for m in listed.json()["data"]] == ["test-model"]  # the other engine's


def test_a_router_starts_in_front_of_an_engine_listing_models_nested_past_the_parser() -> None:
    # The names are learned at start-up: the RecursionError failed the router's start.
    with (
        tempfile.TemporaryDirectory() as store,
        ServerThread(FakeEngine(models_answer=NESTED).app()) as fast,
        ServerThread(FakeEngine().app()) as team,
    ):
        settings = Settings(**settings_data(fast.url, team.url, batch={"store_dir": store}))
        app = create_app(settings, registry=CollectorRegistry())
        with ServerThread(app, fast=True) as router:
            assert httpx.get(router.url + "/readyz", timeout=30).status_code == 200
