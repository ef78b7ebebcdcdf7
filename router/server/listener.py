"""How the router listens: uvicorn's settings, built in one place (`uvicorn_config`), with the
connection protocol that holds clients to the limits (router.server.uvicorn_private)."""

from __future__ import annotations

from typing import Any

import uvicorn

from router.config import Settings
from router.server.uvicorn_private import ClientLimits, ClientProtocol


def uvicorn_config(
    app: Any, settings: Settings, *, host: str | None = None, port: int | None = None, log_level: str = "info"
) -> uvicorn.Config:
    """The one place where the router's settings become uvicorn's (`specroute serve`, the
    embedded simulated cluster and the tests all serve the router through it)."""
    limits = ClientLimits(
        head_bytes=settings.limits.request_head_bytes,
        head_fields=settings.limits.request_headers,
        head_seconds=settings.timeouts.request_head,
        write_seconds=settings.timeouts.client_write,
        max_connections=settings.limits.max_connections,
    )

    class Protocol(ClientProtocol):
        client_limits = limits

    return uvicorn.Config(
        app,
        host=host or settings.listen.host,
        port=settings.listen.port if port is None else port,
        loop="uvloop",
        http=Protocol,
        ws="none",  # the router serves no websockets; an upgrade request is refused (see ClientProtocol)
        timeout_keep_alive=settings.timeouts.keep_alive,  # type: ignore[arg-type]  # any number works
        forwarded_allow_ips=settings.listen.forwarded_allow_ips,
        access_log=False,  # the router writes its own, one line per request
        server_header=False,
        log_level=log_level,
        log_config=None,  # uvicorn's lines go through the router's own format (router.logs)
    )
