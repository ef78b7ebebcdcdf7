"""The values the first stages hand on: a request as it arrived, and as ingress accepted it.

Plain records, with no I/O, so that the decision stage (router.decide) can take them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from router.content import PromptText, read_prompt

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Arrival:
    """What the request line and headers say, before anything is checked."""

    request_id: str
    method: str  # GET, HEAD, POST or DELETE (the methods the proxy serves)
    path: str  # percent-decoded, for the router's own decisions
    target: str  # the path and query exactly as the client sent them, forwarded as they are
    headers: Mapping[str, str]  # lower-cased names, as the client sent them
    started: float  # clock seconds at arrival


@dataclass(frozen=True, slots=True)
class Incoming:
    """A request that ingress accepted: its client is allowed, its body read and parsed."""

    arrival: Arrival
    headers: Mapping[str, str]  # lower-cased; override headers this client may not use removed
    api_key: str | None
    client: str  # who sent it (router.clients.client_id); logged only as a hash
    body: bytes
    # The JSON object of the body; never changed. Empty for a body that is not JSON (multipart,
    # audio) or a GET or DELETE: those are forwarded byte for byte, classified by headers alone.
    payload: Mapping[str, Any]
    group: str | None = None  # the key group of `fairness.groups` its key is in, if any
    internal: bool = False  # the router's own request (a Batch API line): no client limits
    prompt: PromptText = field(init=False)  # the payload's prompt, read once for every stage

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt", read_prompt(self.payload))

    @property
    def stream(self) -> bool:
        return self.payload.get("stream") is True

    def field(self, key: str, kind: type[T]) -> T | None:
        """A top-level field of the body if it has that type (else None)."""
        return field_of(self.payload, key, kind)


def field_of(payload: Mapping[str, Any], key: str, kind: type[T]) -> T | None:
    value = payload.get(key)
    # bool is an int to Python, but `"n": true` is not a count.
    return value if isinstance(value, kind) and not isinstance(value, bool) else None
