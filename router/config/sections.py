"""The router's own surface: where it listens, its header names, keys, shutdown, logs and labels."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from router.config.base import Section


class Listen(Section):
    """Where the router listens, and which proxies may name the client."""

    host: str = Field(default="127.0.0.1", description="Address the router listens on.")
    port: int = Field(default=8000, ge=0, le=65535, description="Port the router listens on.")
    workers: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Worker processes accepting on the port (`SO_REUSEPORT`), each one event loop on one core. "
        "Past one, a supervisor process shares the client memory, the backends' slots and the requests sent since "
        "a scrape between them, restarts a worker that dies and aggregates `/metrics` (see Worker processes). "
        "`specroute serve --workers N` overrides it.",
    )
    forwarded_allow_ips: list[str] = Field(
        default=["127.0.0.1", "::1"],
        description="Proxies trusted to name the client in `X-Forwarded-For` (and the scheme in "
        '`X-Forwarded-Proto`): addresses, networks (`10.0.0.0/8`) or `"*"`. Another peer\'s header is ignored '
        "and the client is the address it came from. Set it to your load balancer's address.",
    )


class Headers(Section):
    """Names of the headers the router reads: the override headers (never forwarded) and the first-token target."""

    pool: str = Field(default="X-Route-Pool", description="The header that pins a pool by name.")
    job: str = Field(default="X-Job-Type", description="The header that declares the job: `interactive` or `batch`.")
    ttft_target: str = Field(
        default="X-SLO-TTFT-MS",
        description="The header with a request's own first-token target, in milliseconds (llm-d's name); it "
        "replaces `routing.ttft_target` for that request, within `ttft_target_min` and `ttft_target_max`. A "
        "value that is not a positive number is ignored. Forwarded like any header.",
    )


class Auth(Section):
    """Keys, always read from the environment, never from the file."""

    client_keys_env: str | None = Field(
        default=None,
        description="Environment variable with the client API keys, comma-separated. Unset: no key needed.",
    )
    override_keys_env: str | None = Field(
        default=None,
        description="Environment variable with the keys that may use the override headers. Unset: anyone.",
    )
    untrusted_overrides: Literal["ignore", "reject"] = Field(
        default="ignore",
        description="Override headers from other keys are dropped (`ignore`) or answered 403 `override_denied` "
        "(`reject`).",
    )
    admin_key_env: str | None = Field(
        default=None,
        description="Environment variable with the admin key for `/admin/*` (drain, resume, reload). Unset: the "
        "admin API is off (403). Client keys never open it.",
    )


class Shutdown(Section):
    """What SIGTERM does: stop accepting, let running requests finish, then end the rest."""

    grace_seconds: float = Field(
        default=30.0,
        ge=0,
        description="Seconds running requests may take to finish after SIGTERM; then open streams end with an "
        "error event (`shutting_down`). Give the container runtime a few seconds more.",
    )


class Log(Section):
    """The log's format."""

    format: Literal["text", "json"] = Field(
        default="text",
        description="`text`: `key=value` lines; `json`: one object a line, for a log pipeline. `--log-format` "
        "overrides it.",
    )


class MetricsConfig(Section):
    """What the router's `/metrics` labels may hold."""

    models: list[str] = Field(
        default=[],
        description="Model names counted under their own name in the `model` label besides those the backends "
        "list (e.g. names a rule rewrites); any other name is `other`.",
    )


class Traffic(Section):
    """The traffic record (router.traffic): what the router served, for `specroute plan` to replay."""

    path: str | None = Field(
        default=None,
        description="File the record is written to, one JSON line per finished request (sizes and hashes, no "
        "prompt or answer text). Unset: no record is kept. `specroute trace export` reads it.",
    )
    max_bytes: int = Field(
        default=64 * 1024 * 1024,
        ge=4096,
        description="Size at which the file is moved aside to `<path>.1` (replacing the older one): the record "
        "never takes more than twice this on disk.",
    )
    buffer: int = Field(
        default=10_000,
        ge=1,
        description="Entries held in memory until written; past it, entries are dropped and counted, never held "
        "up on the request path.",
    )
    flush_seconds: float = Field(default=1.0, gt=0, description="How often the buffer is written to the file.")


class Tracing(Section):
    """OpenTelemetry traces of the requests (docs/tracing.md); needs `specroute[otel]`. Read at start only."""

    enabled: bool = Field(
        default=False,
        description="Send a span per request over OTLP/HTTP and pass its `traceparent` to the engine. Off: nothing "
        "of OpenTelemetry is loaded, and a client's `traceparent` goes to the engine as it came.",
    )
    endpoint: str | None = Field(
        default=None,
        description="The OTLP/HTTP traces endpoint (`http://collector:4318/v1/traces`). Unset: "
        "`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, else `OTEL_EXPORTER_OTLP_ENDPOINT` + `/v1/traces`, else "
        "`http://localhost:4318/v1/traces`, as the OpenTelemetry SDK reads them.",
    )
    sample_ratio: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="Share of new traces recorded; a request arriving with a `traceparent` follows its sampled "
        "flag. Unset: `OTEL_TRACES_SAMPLER` and `OTEL_TRACES_SAMPLER_ARG` decide (by default, every request).",
    )
    service_name: str | None = Field(
        default=None,
        description="The spans' `service.name`. Unset: `OTEL_SERVICE_NAME` (or `OTEL_RESOURCE_ATTRIBUTES`), else "
        "`specroute`.",
    )
