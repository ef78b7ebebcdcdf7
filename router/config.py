"""Settings: one YAML file, overridden by `SPECROUTE_*` environment variables.

Pools and backends are maps keyed by name, so names are unique by construction and an
environment variable can reach any of them, e.g. `SPECROUTE_POOLS__FAST__SPECULATIVE=false`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from router.content import CONTENT_KINDS, ContentKind

JobClass = Literal["interactive", "batch"]

CONFIG_ENV = "SPECROUTE_CONFIG"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Listen(_Model):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    # Peers trusted to say who the client is (X-Forwarded-For, X-Forwarded-Proto): addresses or
    # networks, or "*". A request from anyone else is the address it came from. uvicorn's default.
    forwarded_allow_ips: list[str] = ["127.0.0.1", "::1"]


class Backend(_Model):
    url: str
    # Name of the environment variable holding the upstream's API key, never the key itself.
    api_key_env: str | None = None
    max_concurrency: int = Field(default=64, ge=1)

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        if "@" in urlsplit(value).netloc:
            # Never echoed: the message must not carry the password.
            raise ValueError(
                "must not hold a user name or password (user:pass@); give the engine's key in the "
                "environment variable named by api_key_env"
            )
        # The engine's root: request paths such as /v1/chat/completions are appended to it.
        return value.rstrip("/").removesuffix("/v1")

    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None


class Pool(_Model):
    speculative: bool
    backends: dict[str, Backend] = Field(min_length=1)
    # Router-side queue used when every backend of the pool is at max_concurrency.
    queue_size: int = Field(default=256, ge=0)
    queue_timeout: float = Field(default=30.0, gt=0)
    # What the pool's engines are known to give before the router has measured anything: per-user
    # tokens/s by concurrency, per content kind (e.g. `prose: {1: 57, 4: 29.8}`), as `specroute
    # bench sweep` measures it. Learned speeds are shrunk toward it (`learn.prior_weight`); the
    # policy uses it until it has learned better. Empty: no prior, the configured crossover decides.
    prior_speed: dict[ContentKind, dict[int, float]] = {}

    @field_validator("prior_speed")
    @classmethod
    def _speed_table(cls, value: dict[ContentKind, dict[int, float]]) -> dict[ContentKind, dict[int, float]]:
        for kind, table in value.items():
            if not table:
                raise ValueError(f"{kind}: give at least one concurrency: tokens/s")
            for concurrency, speed in table.items():
                if concurrency < 1:
                    raise ValueError(f"{kind}: concurrency {concurrency} must be at least 1")
                if not 0 < speed < float("inf"):
                    raise ValueError(f"{kind}: tokens/s at {concurrency} must be a positive number, not {speed}")
        return {kind: dict(sorted(table.items())) for kind, table in value.items()}


class Headers(_Model):
    pool: str = "X-Route-Pool"
    job: str = "X-Job-Type"


class Match(_Model):
    """All given fields must match; strings are shell-style globs (`*`, `?`)."""

    api_key: SecretStr | None = None
    headers: dict[str, str] = {}
    user_agent: str | None = None
    model: str | None = None
    user: str | None = None
    metadata: dict[str, str] = {}


class Rule(_Model):
    name: str
    job: JobClass
    match: Match
    # Forward the request with this model name (a model alias such as `glm-batch`).
    rewrite_model: str | None = None


class Classify(_Model):
    rules: list[Rule] = []
    # A client with this many requests in flight (before the new one) is treated as a batch job.
    batch_inflight_threshold: int = Field(default=4, ge=1)
    # ...and is remembered: its peak in flight counts, halving every this many seconds (0: off).
    client_memory_seconds: float = Field(default=60.0, ge=0)
    # The first requests of a client not seen lately wait this long (or until it has more than
    # batch_inflight_threshold here), so that a batch job's first burst is recognised as one.
    burst_hold_seconds: float = Field(default=0.02, ge=0)
    # Text that marks a request as code, besides code fences, code-like tokens and tool definitions.
    code_hints: list[str] = []


class Routing(_Model):
    # Where each job class goes; by default the first speculative and the first standard pool.
    interactive_pool: str | None = None
    batch_pool: str | None = None
    # static: interactive to the speculative pool, always. crossover: spill past the crossover
    # concurrency. adaptive: to the pool with the higher learned per-user speed.
    mode: Literal["static", "crossover", "adaptive"] = "adaptive"
    # Concurrency on a speculative backend past which it stops being the faster place (the note:
    # about 4 for prose; code, which is guessed well, later).
    crossover: dict[ContentKind, int] = {"prose": 4, "code": 16}
    # Spill when a speculative engine's KV cache is at least this full: the next request would wait.
    kv_threshold: float = Field(default=0.9, gt=0, le=1)
    # Let batch work use the speculative pool's idle room when the standard pool is down or full.
    batch_may_use_speculative: bool = False
    # The first-token wait interactive users should not exceed: interactive work goes where its
    # first token is predicted within this, then where it streams fastest.
    ttft_target: float = Field(default=3.0, gt=0)


class Scrape(_Model):
    # Engines' /metrics are read this often; a reading older than stale_after is not used.
    interval: float = Field(default=1.0, gt=0)
    timeout: float = Field(default=0.5, gt=0)
    stale_after: float = Field(default=5.0, gt=0)
    # The last speculative acceptance measured is used this long: an idle engine drafts nothing,
    # so its newest scrapes have no figure of their own.
    acceptance_max_age: float = Field(default=300.0, gt=0)


class Learn(_Model):
    # A learned speed counts only once it rests on this many answers and its 95 % confidence
    # interval is within `max_interval` of it (a share); until then the prior decides.
    min_samples: int = Field(default=8, ge=1)
    max_interval: float = Field(default=0.1, gt=0)
    # Old answers fade: their weight halves every this many seconds.
    half_life: float = Field(default=600.0, gt=0)
    # How many answers a pool's `prior_speed` counts as at each concurrency: a learned point is
    # pulled toward the prior by this weight against its own (faded) answers. 0: the prior is
    # used only where nothing is learned.
    prior_weight: float = Field(default=8.0, ge=0)


class Timeouts(_Model):
    connect: float = Field(default=5.0, gt=0)
    # Longest wait for the response to start (a whole answer, when it is not streamed).
    read: float = Field(default=600.0, gt=0)
    # Longest silence between chunks once a response has started: a stalled stream ends here.
    idle: float = Field(default=60.0, gt=0)
    # Longest time a client may take to send its request body.
    client_body: float = Field(default=30.0, gt=0)
    # Longest time a client may take to send a request's head (line and headers), and a new
    # connection its first byte; then the connection is closed (a head begun is answered 408).
    # Slow-header and silent clients cannot hold connections open.
    request_head: float = Field(default=10.0, gt=0)
    # How long an idle client keep-alive connection is kept open between requests.
    keep_alive: float = Field(default=5.0, gt=0)
    # Longest time a client may leave streamed data untaken; then its stream is closed and the
    # engine request cancelled, so a client that stops reading cannot hold a backend slot.
    client_write: float = Field(default=30.0, gt=0)


class Limits(_Model):
    """Hard limits on what clients and engines may send; each is answered, never buffered past."""

    # A client's request head (request line and headers): larger -> 431, nothing forwarded.
    # nginx allows 4 x 8 KiB by default, Envoy 60 KiB.
    request_head_bytes: int = Field(default=64 * 1024, ge=1024)
    request_headers: int = Field(default=100, ge=1)
    # Open client connections; more are answered 503 and closed at once, before anything is
    # read, rather than running out of descriptors.
    max_connections: int = Field(default=4096, ge=1)
    # JSON nested deeper than this is 400 invalid_json (Python's parser would recurse).
    json_depth: int = Field(default=64, ge=1)
    # An engine's response head, and a whole (not streamed) response body: larger -> 502.
    response_head_bytes: int = Field(default=64 * 1024, ge=1024)
    response_headers: int = Field(default=100, ge=1)
    response_body_bytes: int = Field(default=64 * 1024 * 1024, ge=1)
    # One server-sent event of a stream: larger ends the stream with an error event.
    sse_event_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)


class Tls(_Model):
    """How the router checks engines served over https (the system trust store by default)."""

    # A PEM bundle of the CAs to trust instead of the system store.
    ca_bundle: str | None = None
    # A client certificate (PEM) and its key, for engines that require one.
    client_cert: str | None = None
    client_key: str | None = None
    # false: do not verify the engines' certificates at all (named explicitly; never the default).
    verify: bool = True

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


class Health(_Model):
    # Active checks: GET /health of every backend.
    interval: float = Field(default=5.0, gt=0)
    timeout: float = Field(default=2.0, gt=0)
    unhealthy_after: int = Field(default=2, ge=1)  # failed probes in a row that take a backend out
    healthy_after: int = Field(default=2, ge=1)  # good probes in a row that bring it back
    # Passive ejection: requests that fail in a row (no connection, 5xx, timeout) take a backend
    # out for ejection_seconds, doubling each time it is ejected again before a success.
    eject_after: int = Field(default=3, ge=1)
    ejection_seconds: float = Field(default=10.0, gt=0)
    max_ejection_seconds: float = Field(default=300.0, gt=0)


class Retries(_Model):
    # Failures before any byte reached the client (no connection, 502/503/504, no response) are
    # tried again: on another backend of the pool, then on another pool (same model).
    attempts: int = Field(default=3, ge=1)  # in all, the first included
    deadline: float = Field(default=30.0, gt=0)  # no new attempt this long after the first
    cross_pool: bool = True
    # At most this share of the requests in flight may be retries (and always min_concurrent).
    budget: float = Field(default=0.2, ge=0, le=1)
    min_concurrent: int = Field(default=3, ge=0)


class Auth(_Model):
    # Environment variable holding the client API keys (comma-separated); unset: no keys needed.
    client_keys_env: str | None = None
    # Environment variable holding the keys that may use the override headers; unset: anyone.
    override_keys_env: str | None = None
    # What override headers from other clients do: nothing (ignored) or a 403.
    untrusted_overrides: Literal["ignore", "reject"] = "ignore"
    # Environment variable holding the admin key, for /admin/* (drain, resume, reload); unset:
    # the admin API is off. Client keys never open it.
    admin_key_env: str | None = None


class Shutdown(_Model):
    # On SIGTERM the router stops accepting, lets running requests finish for this long, then
    # ends the streams still open with an error event.
    grace_seconds: float = Field(default=30.0, ge=0)


class Log(_Model):
    # `text`: one `key=value` line per request; `json`: one JSON object a line, for a log pipeline.
    format: Literal["text", "json"] = "text"


class MetricsConfig(_Model):
    # Model names that may be a `model` label value besides those the backends list in
    # /v1/models (e.g. names a rule rewrites); any other name is counted as `other`.
    models: list[str] = []


class Responses(_Model):
    """The Responses API's stored responses live on the engine that made them: where they went."""

    # How long the router remembers which backend produced a response id, and for how many ids
    # at most (the oldest go first). After that, or a restart, such a request is routed as usual.
    affinity_seconds: float = Field(default=3600.0, ge=0)
    affinity_max: int = Field(default=100_000, ge=0)
    # An id it does not remember (another replica made it, or a restart): the healthy backends are
    # asked `GET /v1/responses/{id}` at once, for at most this long (0: not asked, routed as usual),
    # by at most `locate_concurrency` searches at a time; an id none of them holds is not asked
    # about again for `locate_miss_seconds` (router.locate).
    locate_timeout: float = Field(default=0.5, ge=0)
    locate_concurrency: int = Field(default=32, ge=1)
    locate_miss_seconds: float = Field(default=10.0, ge=0)


class Batch(_Model):
    """The Batch API (`/v1/files`, `/v1/batches`): where its state lives and how hard it may push."""

    # false: no /v1/files or /v1/batches of the router's own (they are forwarded like any POST).
    # Read once at start, as are the store settings below.
    enabled: bool = True
    # Where files, batches and every line's result live: `sqlite`, a database file in store_dir
    # (one replica, or several on one host), or `postgres`, one database server that several
    # replicas share. Read once at start: changing it needs a restart.
    store: Literal["sqlite", "postgres"] = "sqlite"
    # The SQLite database's directory (relative to the working directory); with either store,
    # where an upload waits, unnamed, while it is checked.
    store_dir: str = "specroute-batches"
    # With `store: postgres`: the name of the environment variable holding the connection string
    # (`postgresql://user:password@host/db` or `host=... dbname=...`), never the string itself.
    postgres_dsn_env: str | None = None
    # An uploaded file larger than this is refused (413 file_too_large); OpenAI allows 200 MB. At
    # most 10^9: SQLite's largest value (SQLITE_MAX_LENGTH), and the store keeps a file as one.
    max_file_bytes: int = Field(default=200 * 1024 * 1024, ge=1, le=1_000_000_000)
    # Longest time a client may take to send an upload's body (408 body_timeout): what
    # timeouts.client_body is for other requests, longer because a batch file is large.
    upload_timeout: float = Field(default=600.0, gt=0)
    # Files kept in all (inputs, outputs, error files); an upload past it is refused (413 storage_full).
    max_storage_bytes: int = Field(default=10 * 1024**3, ge=1)
    # Requests in one input file; OpenAI allows 50,000.
    max_lines: int = Field(default=50_000, ge=1)
    # Lines in flight at most, whatever the pools have free.
    max_concurrency: int = Field(default=64, ge=1)
    # Slots of the batch pool that batch lines leave free, so that live requests never queue.
    reserve_slots: int = Field(default=1, ge=0)
    # How often the runner looks at the pools, adapts its concurrency and checks expiry.
    poll_interval: float = Field(default=0.5, gt=0)
    # Back off when the batch pool's recent first-token p50 exceeds this many times its lowest.
    ttft_rise: float = Field(default=2.0, gt=1)
    # A line taken by a router is its own for this long (renewed while it runs); a router that
    # died leaves its lines to another (or to itself after a restart) once this has passed.
    lease_seconds: float = Field(default=60.0, gt=0)
    # A line answered 429, 502, 503 or 504, or not answered at all (an empty body, a fault of the
    # router's own), is tried again later, after `retry_backoff` seconds doubling each time, at
    # most this many times in all; then its last answer is recorded (in the error file).
    max_attempts: int = Field(default=5, ge=1)
    retry_backoff: float = Field(default=1.0, gt=0)

    @model_validator(mode="after")
    def _postgres_needs_its_dsn(self) -> Batch:
        if self.store == "postgres" and not self.postgres_dsn_env:
            raise ValueError("store postgres needs postgres_dsn_env: the environment variable holding its DSN")
        return self

    def postgres_dsn(self) -> str | None:
        return os.environ.get(self.postgres_dsn_env) if self.postgres_dsn_env else None


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECROUTE_", env_nested_delimiter="__", extra="forbid", frozen=True)

    listen: Listen = Listen()
    pools: dict[str, Pool] = Field(min_length=1)
    headers: Headers = Headers()
    classify: Classify = Classify()
    routing: Routing = Routing()
    timeouts: Timeouts = Timeouts()
    health: Health = Health()
    scrape: Scrape = Scrape()
    learn: Learn = Learn()
    retries: Retries = Retries()
    auth: Auth = Auth()
    shutdown: Shutdown = Shutdown()
    limits: Limits = Limits()
    tls: Tls = Tls()
    log: Log = Log()
    metrics: MetricsConfig = MetricsConfig()
    batch: Batch = Batch()
    responses: Responses = Responses()
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1)
    models_cache_seconds: float = Field(default=5.0, ge=0)
    # Pass the client's Authorization header upstream when the backend has no key of its own.
    forward_client_authorization: bool = False

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The file arrives as init kwargs; the environment overrides it.
        return (env_settings, init_settings)

    @model_validator(mode="after")
    def _routing_names_exist(self) -> Settings:
        for field in ("interactive_pool", "batch_pool"):
            name = getattr(self.routing, field)
            if name is not None and name not in self.pools:
                raise ValueError(f"routing.{field}: no pool named {name!r}")
        if set(self.routing.crossover) != set(CONTENT_KINDS):
            raise ValueError("routing.crossover: give both prose and code")
        backends = [b for pool in self.pools.values() for b in pool.backends]
        if len(backends) != len(set(backends)):
            raise ValueError("backend names must be unique across pools")
        return self

    def pool_for(self, job: JobClass) -> str:
        """The pool a job class goes to when nothing else decides."""
        configured = self.routing.interactive_pool if job == "interactive" else self.routing.batch_pool
        if configured is not None:
            return configured
        want_speculative = job == "interactive"
        for name, pool in self.pools.items():
            if pool.speculative == want_speculative:
                return name
        return next(iter(self.pools))


class ConfigError(Exception):
    """A configuration file that cannot be used; the message names the field and why."""


def load_settings(path: str | Path | None = None) -> Settings:
    """Read `path` (or `$SPECROUTE_CONFIG`), apply environment overrides, validate."""
    path = path or os.environ.get(CONFIG_ENV)
    data: dict[str, Any] = {}
    if path:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"{path}: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
        data = loaded
    try:
        return Settings(**data)
    except ValidationError as exc:
        raise ConfigError(describe_errors(exc)) from exc


def describe_errors(exc: ValidationError) -> str:
    lines = []
    for error in exc.errors():
        field = ".".join(str(part) for part in error["loc"]) or "(top level)"
        lines.append(f"{field}: {error['msg']}")
    return "\n".join(lines)


def masked(settings: Settings) -> dict[str, Any]:
    """The resolved settings as plain data, secrets shown as `***`."""
    data: dict[str, Any] = settings.model_dump(mode="json")
    for pool in data["pools"].values():
        for backend in pool["backends"].values():
            env = backend["api_key_env"]
            if env:
                backend["api_key_env"] = f"{env} ({'set' if os.environ.get(env) else 'NOT SET'})"
    for field in ("client_keys_env", "override_keys_env"):
        env = data["auth"][field]
        if env:
            count = len([k for k in os.environ.get(env, "").split(",") if k.strip()])
            data["auth"][field] = f"{env} ({count} keys)"
    env = data["batch"]["postgres_dsn_env"]
    if env:
        data["batch"]["postgres_dsn_env"] = f"{env} ({'set' if os.environ.get(env) else 'NOT SET'})"
    for rule in data["classify"]["rules"]:
        if rule["match"]["api_key"] is not None:
            rule["match"]["api_key"] = "***"
    return data
