"""The memory of which backend made each stored response: bounded in size and in time."""

from __future__ import annotations

from router.config import Responses
from router.responses.affinity import ResponseAffinity, made_response, response_ref


def test_ids_are_named_by_path_or_previous_response_id() -> None:
    assert response_ref("GET", "/v1/responses/resp-1", {}) == "resp-1"
    assert response_ref("DELETE", "/v1/responses/resp-1", {}) == "resp-1"
    assert response_ref("GET", "/v1/responses/resp-1/input_items", {}) == "resp-1"
    assert response_ref("POST", "/v1/responses", {"previous_response_id": "resp-2"}) == "resp-2"
    assert response_ref("POST", "/v1/responses", {"previous_response_id": 5}) is None
    assert response_ref("POST", "/v1/chat/completions", {"previous_response_id": "resp-2"}) is None
    assert response_ref("GET", "/v1/responses/a/b/c", {}) is None
    assert made_response("POST", "/v1/responses") and not made_response("GET", "/v1/responses")


def test_the_oldest_go_first_past_the_bound() -> None:
    owners = ResponseAffinity()
    owners.configure(Responses(affinity_seconds=60, affinity_max=2))
    for n in range(3):
        owners.remember(f"r{n}", f"b{n}", now=0)
    assert len(owners) == 2
    assert owners.owner("r0", now=1) is None
    assert (owners.owner("r1", now=1), owners.owner("r2", now=1)) == ("b1", "b2")
    owners.configure(Responses(affinity_seconds=60, affinity_max=1))  # a reload to fewer
    assert len(owners) == 1 and owners.owner("r2", now=1) == "b2"


def test_ids_expire_and_are_dropped_as_new_ones_come() -> None:
    owners = ResponseAffinity()
    owners.configure(Responses(affinity_seconds=10, affinity_max=100))
    owners.remember("old", "b1", now=0)
    assert owners.owner("old", now=9.9) == "b1"
    owners.remember("new", "b2", now=10)  # the expired one goes without being asked for
    assert len(owners) == 1
    assert owners.owner("old", now=10) is None and owners.owner("new", now=19) == "b2"
    owners.forget("new")
    assert owners.owner("new", now=19) is None


def test_zero_remembers_nothing() -> None:
    for config in (Responses(affinity_seconds=0), Responses(affinity_max=0)):
        owners = ResponseAffinity()
        owners.configure(config)
        owners.remember("r", "b", now=0)
        assert len(owners) == 0 and owners.owner("r", now=0) is None


def test_an_id_no_engine_would_make_is_not_remembered() -> None:
    # The id is the engine's to choose: a broken or hostile one may send megabytes of it, and
    # `affinity_max` of those would hold gigabytes.
    owners = ResponseAffinity()
    owners.configure(Responses(affinity_seconds=60, affinity_max=100))
    for hostile in ("r" * (1 << 20), "r" * 129, "resp/../../health", "résp-1", ""):
        owners.remember(hostile, "b1", now=0)
    assert len(owners) == 0
    owners.remember("r" * 128, "b1", now=0)
    owners.remember("resp_67ccd2bed1ec8190b14f964abc0542670bb6a6b452d3795b", "b2", now=0)
    assert len(owners) == 2
