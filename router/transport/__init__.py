"""The engine client: what the router needs of one (base.py) and the one it uses
(aiohttp_client.py, with aiohttp's private internals it overrides kept in aiohttp_private.py)."""

from router.transport.aiohttp_client import AiohttpTransport
from router.transport.aiohttp_private import KEEP_ALIVE_SECONDS
from router.transport.base import (
    ConnectError,
    HeadLimits,
    NotSent,
    ReadTimeout,
    RemoteProtocolError,
    Response,
    Timeouts,
    TlsError,
    TooLarge,
    Transport,
    TransportError,
    WrongAnswer,
    tls_context,
)

__all__ = [
    "KEEP_ALIVE_SECONDS",
    "AiohttpTransport",
    "ConnectError",
    "HeadLimits",
    "NotSent",
    "ReadTimeout",
    "RemoteProtocolError",
    "Response",
    "Timeouts",
    "TlsError",
    "TooLarge",
    "Transport",
    "TransportError",
    "WrongAnswer",
    "tls_context",
]
