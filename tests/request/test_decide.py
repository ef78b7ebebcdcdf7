"""The decision stage as a pure function: a request's own first-token target; the body sent on."""

from __future__ import annotations

from typing import Any

import pytest

from router.config import Classify, Routing
from router.errors import NoBackendAvailable
from router.request.decide import TtftTarget, decide, with_appended, with_field
from router.request.incoming import Arrival, Incoming
from router.routing.classify import Classifier
from router.routing.policy import Policy, PoolState


def test_a_requests_first_token_target_is_read_in_milliseconds_within_bounds() -> None:
    target = TtftTarget(header="x-slo-ttft-ms", low=0.05, high=60.0, reject_unmeetable=False)
    assert target.of({"x-slo-ttft-ms": "500"}) == 0.5
    assert target.of({"x-slo-ttft-ms": "2.5"}) == 0.05  # raised to the floor
    assert target.of({"x-slo-ttft-ms": "86400000"}) == 60.0  # lowered to the ceiling
    for ignored in ("", "soon", "-5", "0", "nan", "inf", "1e999"):
        assert target.of({"x-slo-ttft-ms": ignored}) is None, ignored
    assert target.of({}) is None


def test_a_target_no_pool_meets_is_503_only_when_the_settings_say_so() -> None:
    headers = {"x-slo-ttft-ms": "100"}
    incoming = Incoming(
        Arrival("id", "POST", "/v1/chat/completions", "/v1/chat/completions", headers, 0.0),
        headers,
        None,
        "addr:a",
        b"{}",
        {"messages": [{"role": "user", "content": "hi"}]},
    )
    pools = {"fast": PoolState(True, ttft=2.0), "team": PoolState(False, ttft=0.4)}

    def routed(reject: bool) -> Any:
        return decide(
            incoming,
            classifier=Classifier(
                Classify(), pool_header="x-route-pool", job_header="x-job-type", pools=frozenset(pools)
            ),
            policy=Policy(Routing(), interactive_pool="fast", batch_pool="team"),
            code_hints=(),
            client_load=0,
            pools=pools,
            ttft=TtftTarget(header="x-slo-ttft-ms", low=0.05, high=60.0, reject_unmeetable=reject),
        )

    assert (routed(False).decision.pool, routed(False).decision.reason) == ("team", "slo:unmet")
    with pytest.raises(NoBackendAvailable) as refused:
        routed(True)
    assert refused.value.code == "ttft_target_unmeetable" and refused.value.status_code == 503
    assert "fast 2.00 s" in refused.value.message and "team 0.40 s" in refused.value.message


@pytest.mark.parametrize(
    ("body", "sent"),
    [
        (b'{"a":1}', b'{"a":1,"b":[true]}'),
        (b'{ "a" : 1 }\r\n \t', b'{ "a" : 1 ,"b":[true]}'),
        (b'{"a":"}"}', b'{"a":"}","b":[true]}'),
        (b"{}", None),  # no field for the new one to follow
        (b"{ \n }", None),
        (b' {"a":1}', None),  # not what a client sends: encoded anew
        (b'\xef\xbb\xbf{"a":1}', None),  # after a UTF-8 BOM
        ('{"a":1}'.encode("utf-16-le"), None),
        ('{"a":1}'.encode("utf-16-be"), None),
        ('{"a":1}'.encode("utf-32"), None),
        (b"", None),
        (b"{", None),
    ],
)
def test_fields_are_appended_to_a_json_objects_bytes_or_not_at_all(body: bytes, sent: bytes | None) -> None:
    assert with_appended(body, {"b": [True]}) == sent


def test_a_field_is_appended_only_where_it_is_known_absent() -> None:
    assert with_field(b'{"a":1, "p":2}', "q", 3, absent=True) == b'{"a":1, "p":2,"q":3}'
    assert with_field(b'{"a":1, "p":2}', "p", 3) == b'{"a":1,"p":3}'  # the client's own, replaced
    assert with_field('{"a":1}'.encode("utf-16"), "q", 3, absent=True) == b'{"a":1,"q":3}'
