"""Ingress, the first stage: who sent the request, may they, and what did they send.

Checks the path and the client's key (before the body is read), drops the override headers
this client may not use, reads the body within its size and time limits, and parses it as a
JSON object within the depth limit. A body that says it is something else (`multipart/form-data`,
audio, ...) and the body of a GET or DELETE are not parsed: they go upstream byte for byte, and
only headers and rules classify them. Hands on an `Incoming`, or raises the client's error.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from starlette.types import Receive, Scope

from router.auth import INTERNAL_SCOPE_KEY
from router.errors import BadRequest
from router.request.headers import bearer
from router.request.incoming import Arrival, Incoming, field_of
from router.request.payload import parse_json, read_body
from router.request.plan import Plan
from router.routing.clients import client_id

# Media types read as JSON (curl's `-d` sends the form type whatever the body is).
_JSON_LIKE = frozenset({"", "application/json", "text/plain", "application/x-www-form-urlencoded"})
# Control characters (C0 and DEL), which no path has once decoded.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def arrive(scope: Scope, now: float) -> Arrival:
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
    request_id = headers.get("x-request-id") or uuid.uuid4().hex
    return Arrival(request_id, scope["method"], scope["path"], _raw_target(scope), headers, now)


async def accept(arrival: Arrival, scope: Scope, receive: Receive, plan: Plan) -> Incoming:
    _check_path(arrival.path)
    headers = arrival.headers
    api_key = bearer(headers.get("authorization"))
    internal = scope.get(INTERNAL_SCOPE_KEY) is True
    if not internal:  # the router's own batch lines are trusted
        plan.auth.check_client(api_key)  # before the body is read
        refused = {
            name for name in plan.override_headers if name in headers and not plan.auth.may_override(api_key, name)
        }
        if refused:  # from this client they mean nothing
            headers = {name: value for name, value in headers.items() if name not in refused}
    body = await read_body(
        receive, limit=plan.max_body_bytes, within=plan.client_body_seconds, declared=headers.get("content-length")
    )
    payload = _payload(arrival.method, headers.get("content-type"), body, plan.json_depth)
    address = peer(scope)
    user = field_of(payload, "user", str)
    # Any key but a placeholder tells clients apart; a configured client key always does.
    identity = api_key if api_key is not None and (plan.auth.required or api_key not in plan.placeholders) else None
    client = client_id(identity, user, address)
    return Incoming(arrival, headers, api_key, client, body, payload, group=plan.groups.of(api_key), internal=internal)


def peer(scope: Scope) -> str | None:
    """The client's address: the peer's, or the one a trusted proxy named (uvicorn's doing)."""
    client = scope.get("client")
    return str(client[0]) if client else None


def _payload(method: str, content_type: str | None, body: bytes, max_depth: int) -> dict[str, Any]:
    """The body's JSON object, for a POST that is JSON or does not say what it is; else nothing."""
    if method != "POST" or not _json_or_unsaid(content_type):
        return {}
    payload = parse_json(body, max_depth=max_depth)
    if not isinstance(payload, dict):
        raise BadRequest("request body must be a JSON object", code="invalid_json")
    return payload


def _json_or_unsaid(content_type: str | None) -> bool:
    # Many clients send JSON without a Content-Type (or as text/plain, curl's -d sends a form
    # type): only a type that is plainly something else is left unparsed.
    if content_type is None:
        return True
    media = content_type.split(";", 1)[0].strip().lower()
    return media in _JSON_LIKE or media.endswith("+json")


def _raw_target(scope: Scope) -> str:
    # llhttp admits only printable ASCII in a request target, so latin-1 keeps every byte as it is.
    raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
    query: bytes = scope["query_string"]
    return (raw_path + (b"?" + query if query else b"")).decode("latin-1")


def _check_path(path: str) -> None:
    """Refuse a path that means something else once decoded: a dot segment (`%2e%2e`), which
    may climb out of /v1/ at the engine or a proxy in between, or a control character (`%00`).
    Anything else is forwarded raw, percent-encoding and all (`%2F`, `%20`, `%3F`)."""
    if _CONTROL.search(path) or any(segment in (".", "..") for segment in path.split("/")):
        raise BadRequest("the request path has a dot segment or a control character", code="invalid_path")
