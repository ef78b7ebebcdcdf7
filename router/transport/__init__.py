"""The engine client: what the router needs of one (base.py) and the one it uses (client.py:
connections on asyncio protocol callbacks, responses parsed by llhttp, in a keep-alive pool)."""

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
from router.transport.client import EngineClient
from router.transport.pool import KEEP_ALIVE_SECONDS

__all__ = [
    "KEEP_ALIVE_SECONDS",
    "ConnectError",
    "EngineClient",
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
