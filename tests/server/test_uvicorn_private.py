"""The internals of uvicorn's httptools protocol that router/server/uvicorn_private.py relies on:
an upgrade that renames or stops calling one fails here."""

from __future__ import annotations

import inspect

import pytest
from uvicorn.protocols.http import httptools_impl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from router.server.uvicorn_private import ClientProtocol

SOURCE = inspect.getsource(httptools_impl)


@pytest.mark.parametrize(
    "name",
    [
        "on_message_begin",
        "on_url",
        "on_header",
        "on_headers_complete",
        "data_received",
        "connection_made",
        "connection_lost",
        "pause_writing",
        "resume_writing",
        "_unset_keepalive_if_required",
    ],
)
def test_the_methods_client_protocol_overrides_or_calls_exist(name: str) -> None:
    assert callable(getattr(HttpToolsProtocol, name))


@pytest.mark.parametrize(
    "attribute", ["self.parser", "self.cycle", "self.transport", "self.loop", "self.server_state", "self.connections"]
)
def test_the_state_client_protocol_reads_is_kept_by_uvicorn(attribute: str) -> None:
    assert f"{attribute} =" in SOURCE


def test_the_parser_calls_back_into_the_protocol() -> None:
    assert "httptools.HttpRequestParser(self)" in SOURCE
    assert "STATUS_LINE" in SOURCE
    assert ClientProtocol.__mro__[1] is HttpToolsProtocol
