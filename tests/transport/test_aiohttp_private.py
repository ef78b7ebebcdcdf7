"""The private names of aiohttp that router/transport/aiohttp_private.py relies on: an upgrade
that renames or stops calling one fails here, not in a stream on a busy engine."""

from __future__ import annotations

import inspect

import aiohttp
import pytest
from aiohttp import client_proto, client_reqrep, connector

from router.transport.aiohttp_private import Connector, Handler


def _calls(owner: object, call: str) -> bool:
    return call in inspect.getsource(owner)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "call",
    ["self._reschedule_timeout()", "self._reading_paused", "self._read_timeout_handle", "self._on_read_timeout"],
)
def test_the_response_handler_still_runs_what_handler_overrides(call: str) -> None:
    assert _calls(client_proto.ResponseHandler, call)


def test_handler_overrides_names_the_response_handler_has() -> None:
    for name in ("_reschedule_timeout", "_drop_timeout", "_on_read_timeout", "resume_reading"):
        assert callable(getattr(client_proto.ResponseHandler, name)), name
    assert list(inspect.signature(client_proto.ResponseHandler.resume_reading).parameters) == [
        "self",
        "resume_parser",
    ]
    assert Handler.__mro__[1] is client_proto.ResponseHandler


def test_the_connector_still_takes_pooled_connections_through_get_and_builds_with_factory() -> None:
    assert list(inspect.signature(connector.TCPConnector._get).parameters) == ["self", "key", "traces"]
    assert _calls(connector.BaseConnector, "await self._get(")
    assert _calls(connector.TCPConnector, "self._factory")
    assert Connector.__mro__[1] is aiohttp.TCPConnector


def test_a_response_keeps_its_protocol_after_release() -> None:
    assert _calls(client_reqrep.ClientResponse, "self._protocol")
    assert _calls(client_reqrep.ClientResponse, "def release(")
