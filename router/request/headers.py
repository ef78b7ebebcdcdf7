"""Which headers cross the router, in each direction."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from router.tracing import TRACE_HEADERS

# RFC 9110 §7.6.1 hop-by-hop fields, plus those a proxy sets itself.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
# `Expect: 100-continue` is answered by the router's own server; an engine asked for it would send
# a 100 that has nothing to do with the router's request.
_SET_BY_PROXY = frozenset({"host", "content-length", "accept-encoding", "authorization", "x-request-id", "expect"})
# The body reaches the client decoded (see the transport), so its coding and length are not the engine's.
_NOT_RETURNED = frozenset({"content-length", "content-encoding", "server", "date", "x-request-id"})


def _connection_tokens(value: str | None) -> set[str]:
    """Header names listed in `Connection`, which are hop-by-hop too."""
    return {token.strip().lower() for token in (value or "").split(",") if token.strip()}


def request_headers(
    client: Mapping[str, str],
    *,
    drop: frozenset[str],
    request_id: str,
    api_key: str | None,
    forward_authorization: bool,
    trace: Sequence[tuple[str, str]] = (),
) -> list[tuple[str, str]]:
    """Headers for the upstream request, from the client's (lower-cased) headers. `trace`: the
    router's own trace context (router.tracing), in place of the client's."""
    skip = HOP_BY_HOP | _SET_BY_PROXY | drop | _connection_tokens(client.get("connection"))
    if trace:
        skip |= TRACE_HEADERS
    headers = {name: value for name, value in client.items() if name not in skip}
    headers.update(trace)
    headers["x-request-id"] = request_id
    # Identity, so the stream can be inspected as it passes; engines rarely compress anyway.
    headers["accept-encoding"] = "identity"
    if api_key is not None:
        headers["authorization"] = f"Bearer {api_key}"
    elif forward_authorization and "authorization" in client:
        headers["authorization"] = client["authorization"]
    return list(headers.items())


def response_headers(upstream: Iterable[tuple[bytes, bytes]], route: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
    """Headers for the client, from the upstream's raw headers and the router's own."""
    upstream = list(upstream)
    connection = next((v.decode("latin-1") for k, v in upstream if k.lower() == b"connection"), None)
    skip = HOP_BY_HOP | _NOT_RETURNED | set(route) | _connection_tokens(connection)
    headers = [(k, v) for k, v in upstream if k.decode("latin-1").lower() not in skip]
    headers.extend((k.encode("latin-1"), v.encode("latin-1")) for k, v in route.items())
    return headers


def bearer(authorization: str | None) -> str | None:
    if authorization and authorization[:7].lower() == "bearer ":
        return authorization[7:].strip() or None
    return None
