"""The internals of uvicorn's httptools protocol that router/server/uvicorn_private.py relies on:
an upgrade that renames or stops calling one fails here."""

from __future__ import annotations

import inspect

import pytest
from uvicorn.protocols.http import flow_control, httptools_impl
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
    "attribute",
    ["self.parser", "self.cycle", "self.transport", "self.loop", "self.server_state", "self.connections", "self.flow"],
)
def test_the_state_client_protocol_reads_is_kept_by_uvicorn(attribute: str) -> None:
    assert f"{attribute} =" in SOURCE


def test_the_parser_calls_back_into_the_protocol() -> None:
    assert "httptools.HttpRequestParser(self)" in SOURCE
    assert "STATUS_LINE" in SOURCE
    assert ClientProtocol.__mro__[1] is HttpToolsProtocol


@pytest.mark.parametrize(
    "attribute",
    [
        "self.response_started",
        "self.chunked_encoding",
        "self.response_complete",
        "self.disconnected",
        "self.flow",
        "self.scope",
    ],
)
def test_the_state_client_stream_reads_of_a_cycle_is_kept_by_uvicorn(attribute: str) -> None:
    assert f"{attribute} =" in inspect.getsource(httptools_impl.RequestResponseCycle)


def test_a_cycle_writes_a_chunked_body_as_client_stream_does() -> None:
    # ClientStream writes the pieces between the head and the last part: the same framing, and
    # the last part (with the terminating chunk) still goes through the cycle's `send`.
    source = inspect.getsource(httptools_impl.RequestResponseCycle.send)
    assert 'b"%x\\r\\n" % len(body), body, b"\\r\\n"' in source
    assert 'b"0\\r\\n\\r\\n"' in source
    assert "self.write_paused" in inspect.getsource(flow_control)


def test_a_cycle_writes_its_head_and_end_through_its_own_transport() -> None:
    # ClientStream.through swaps a cycle's transport for the length of one `send`, to gather the
    # head (or the last part) with the pieces: the cycle must keep its transport as an attribute
    # and write and close through it.
    cycle = inspect.getsource(httptools_impl.RequestResponseCycle)
    assert "self.transport = transport" in cycle
    send = inspect.getsource(httptools_impl.RequestResponseCycle.send)
    assert "self.transport.write(" in send
    assert "self.transport.close()" in send


def test_a_lost_connection_marks_its_cycle_before_client_stream_hears_it() -> None:
    # ClientStream.watch: ClientProtocol calls the listener after uvicorn's own connection_lost,
    # which marks the cycle disconnected; `receive` resumes reading, as `watch` does.
    lost = inspect.getsource(HttpToolsProtocol.connection_lost)
    assert "self.cycle.disconnected = True" in lost
    assert "self.flow.resume_reading()" in inspect.getsource(httptools_impl.RequestResponseCycle.receive)
