"""Engines served over https, with certificates from a throwaway CA (trustme) on loopback."""

from __future__ import annotations

import asyncio
import logging
import ssl
from pathlib import Path

import pytest
import trustme

from tests.raw_engine import Exchange, RawEngine, completion, response
from tests.transport.test_hostile_engine import answer_text, routed

pytestmark = pytest.mark.e2e  # the router served on loopback in front of engines over https


async def answer_and_close(exchange: Exchange, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """Every request on a connection of its own, so each one shakes hands anew."""
    writer.write(response(body=completion(exchange), headers=b"connection: close\r\n"))
    return False


def server_context(ca: trustme.CA) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    return context


def test_an_untrusted_engine_fails_with_a_clear_502_and_a_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine's certificate is trusted (tls.ca_bundle) and requests work; then it is replaced
    by one from a CA nobody trusts: the next request gets 502 upstream_tls, and the log names the
    backend and why."""
    trusted, stranger = trustme.CA(), trustme.CA()
    bundle = tmp_path / "ca.pem"
    trusted.cert_pem.write_to_path(str(bundle))
    context = server_context(trusted)
    with (
        RawEngine(answer_and_close, keep_alive=False, tls=context) as engine,
        routed(engine.url, tls={"ca_bundle": str(bundle)}) as router,
    ):
        assert answer_text(router.ask("trusted")) == "trusted"
        stranger.issue_cert("127.0.0.1").configure_cert(context)  # new handshakes get the new certificate
        with caplog.at_level(logging.WARNING, logger="specroute"):
            reply = router.ask("untrusted")
        assert reply.status_code == 502
        error = reply.json()["error"]
        assert error["code"] == "upstream_tls" and error["type"] == "upstream_error"
        assert "'e'" in error["message"] and "certificate verify failed" in error["message"]
        assert any("'e'" in r.message and "certificate verify failed" in r.message for r in caplog.records)
        assert router.settled("specroute_in_flight_requests", 0, pool="p", backend="e") == 0


def test_an_engine_untrusted_from_the_start_is_not_ready_and_the_log_says_why(caplog: pytest.LogCaptureFixture) -> None:
    with (
        caplog.at_level(logging.WARNING, logger="specroute"),
        RawEngine(answer_and_close, keep_alive=False, tls=server_context(trustme.CA())) as engine,
        routed(engine.url) as router,
    ):
        assert router.client.get(router.server.url + "/readyz").json()["backends"] == {"e": False}
        assert router.ask("any").status_code == 503
    assert any("'e'" in r.message and "certificate verify failed" in r.message for r in caplog.records)


def test_verify_false_accepts_any_certificate() -> None:
    with (
        RawEngine(answer_and_close, keep_alive=False, tls=server_context(trustme.CA())) as engine,
        routed(engine.url, tls={"verify": False}) as router,
    ):
        assert answer_text(router.ask("unverified")) == "unverified"


def test_a_client_certificate_for_an_engine_that_requires_one(tmp_path: Path) -> None:
    ca = trustme.CA()
    context = server_context(ca)
    context.verify_mode = ssl.CERT_REQUIRED
    ca.configure_trust(context)
    bundle, cert, key = tmp_path / "ca.pem", tmp_path / "client.pem", tmp_path / "client.key"
    ca.cert_pem.write_to_path(str(bundle))
    client = ca.issue_cert("router.internal")
    client.cert_chain_pems[0].write_to_path(str(cert))
    client.private_key_pem.write_to_path(str(key))
    tls = {"ca_bundle": str(bundle), "client_cert": str(cert), "client_key": str(key)}
    with RawEngine(answer_and_close, keep_alive=False, tls=context) as engine:
        with routed(engine.url, tls=tls) as router:
            assert answer_text(router.ask("with-cert")) == "with-cert"
        with routed(engine.url, tls={"ca_bundle": str(bundle)}) as router:
            assert router.ask("without-cert").status_code == 503  # its health check failed
