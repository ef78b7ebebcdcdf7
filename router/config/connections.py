"""Timeouts, limits, TLS, health checks and retries: what the router allows on each connection."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from router.config.base import Section


class Timeouts(Section):
    """How long the router waits for engines and clients."""

    connect: float = Field(default=5.0, gt=0, description="Seconds to connect to a backend.")
    read: float = Field(
        default=600.0,
        gt=0,
        description="Seconds to wait for a backend's response to start (a whole answer, when not streamed).",
    )
    idle: float = Field(
        default=60.0,
        gt=0,
        description="Seconds of silence allowed between chunks once a response has started; a stalled stream "
        "then ends with an error event.",
    )
    client_body: float = Field(
        default=30.0, gt=0, description="Seconds a client may take to send its request body (then 408 `body_timeout`)."
    )
    request_head: float = Field(
        default=10.0,
        gt=0,
        description="Seconds a client may take to send a request's line and headers (408 `head_timeout`), and a "
        "new connection its first byte (closed): a slow or silent client cannot hold a connection.",
    )
    keep_alive: float = Field(
        default=5.0, gt=0, description="Seconds an idle client keep-alive connection stays open between requests."
    )
    client_write: float = Field(
        default=30.0,
        gt=0,
        description="Seconds a client may leave the router's data untaken (its send buffer full); then the "
        "connection is closed and the engine request cancelled, freeing its backend slot.",
    )


class Limits(Section):
    """Hard limits on what clients and engines may send; each is answered, never buffered past."""

    request_head_bytes: int = Field(
        default=64 * 1024,
        ge=1024,
        description="Bytes of a client's request line and headers; larger: 431, nothing forwarded, connection "
        "closed (nginx allows 4 × 8 KiB, Envoy 60 KiB).",
    )
    request_headers: int = Field(default=100, ge=1, description="Header fields of a client's request; more: 431.")
    max_connections: int = Field(
        default=4096,
        ge=1,
        description="Open client connections; more are answered 503 `too_many_connections` as they open, before "
        "anything is read, and closed.",
    )
    json_depth: int = Field(
        default=64, ge=1, description="JSON nested deeper, on `/v1/*` and `/admin/*`, is 400 `invalid_json`."
    )
    response_head_bytes: int = Field(
        default=64 * 1024, ge=1024, description="Bytes of an engine's response head; larger: 502."
    )
    response_headers: int = Field(default=100, ge=1, description="Header fields of an engine's response; more: 502.")
    response_body_bytes: int = Field(
        default=64 * 1024 * 1024, ge=1, description="Bytes of an engine's whole (not streamed) answer; larger: 502."
    )
    sse_event_bytes: int = Field(
        default=4 * 1024 * 1024,
        ge=1024,
        description="Bytes of one server-sent event of a stream; larger ends the stream with an error event.",
    )


class Tls(Section):
    """How the router checks engines served over https (the system trust store by default)."""

    ca_bundle: str | None = Field(
        default=None, description="PEM file of the CAs trusted for https engines. Unset: the system trust store."
    )
    client_cert: str | None = Field(default=None, description="Client certificate (PEM) for engines that require one.")
    client_key: str | None = Field(default=None, description="Its private key (PEM); needs `client_cert`.")
    verify: bool = Field(default=True, description="`false` turns certificate verification off for https engines.")

    @model_validator(mode="after")
    def _files_readable(self) -> Tls:
        # Found at load rather than at the first https request. The certificates themselves are
        # parsed when the router makes its TLS context (router.transport.tls_context): the
        # settings stay free of network modules, as the pure decision modules read them.
        if self.client_key is not None and self.client_cert is None:
            raise ValueError("client_key needs client_cert")
        for path in (self.ca_bundle, self.client_cert, self.client_key):
            if path is None:
                continue
            try:
                pem = Path(path).read_bytes()
            except OSError as exc:
                raise ValueError(f"cannot load the CA bundle or client certificate: {path}: {exc.strerror}") from exc
            if b"-----BEGIN " not in pem:
                raise ValueError(f"cannot load the CA bundle or client certificate: {path} is not PEM")
        return self


class Health(Section):
    """Active `/health` probes of every backend, and passive ejection of backends that fail."""

    interval: float = Field(
        default=5.0, gt=0, description="Seconds between `/health` probes of each backend (probes are not traffic)."
    )
    timeout: float = Field(default=2.0, gt=0, description="Seconds a probe may take.")
    unhealthy_after: int = Field(default=2, ge=1, description="Failed probes in a row that take a backend out.")
    healthy_after: int = Field(default=2, ge=1, description="Good probes in a row that bring it back.")
    eject_after: int = Field(
        default=3,
        ge=1,
        description="Requests failing in a row (no connection, 502/503/504, timeout, broken stream) that eject a "
        "backend.",
    )
    ejection_seconds: float = Field(
        default=10.0,
        gt=0,
        description="Seconds an ejected backend sits out; doubled each time it is ejected again before a success.",
    )
    max_ejection_seconds: float = Field(default=300.0, gt=0, description="Seconds an ejection lasts at most.")


class Retries(Section):
    """Failures before any byte reached the client, tried again on another backend, then another pool."""

    attempts: int = Field(default=3, ge=1, description="Tries in all, the first included.")
    deadline: float = Field(default=30.0, gt=0, description="Seconds after the first try past which none starts.")
    cross_pool: bool = Field(
        default=True,
        description="After the pool's other backends, try another pool (both serve the same model); never for a "
        "pinned pool.",
    )
    budget: float = Field(
        default=0.2, ge=0, le=1, description="Share of the requests in flight that may be retries at most..."
    )
    min_concurrent: int = Field(default=3, ge=0, description="...and the retries always allowed, whatever the share.")
