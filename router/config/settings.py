"""The whole settings, how they are loaded, and how they are shown."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from router.config.base import JobClass
from router.config.batch import Batch, Responses
from router.config.connections import Health, Limits, Retries, Timeouts, Tls
from router.config.fairness import Fairness
from router.config.pools import Discovery, Pool
from router.config.routing import Classify, Conversations, Learn, Routing, Scrape
from router.config.sections import Auth, Headers, Listen, Log, MetricsConfig, Shutdown, Tracing, Traffic
from router.config.state import State
from router.content import CONTENT_KINDS

CONFIG_ENV = "SPECROUTE_CONFIG"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECROUTE_", env_nested_delimiter="__", extra="forbid", frozen=True)

    listen: Listen = Listen()
    pools: dict[str, Pool] = Field(min_length=1, description="The engine pools, by name.")
    headers: Headers = Headers()
    classify: Classify = Classify()
    routing: Routing = Routing()
    conversations: Conversations = Conversations()
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
    traffic: Traffic = Traffic()
    fairness: Fairness = Fairness()
    state: State = State()
    discovery: Discovery = Discovery()
    tracing: Tracing = Tracing()
    max_body_bytes: int = Field(
        default=4 * 1024 * 1024,
        ge=1,
        description="Bytes of a request body; larger: 413 `body_too_large`, refused before it is read in full. Also "
        "the longest line a batch input file may have.",
    )
    models_cache_seconds: float = Field(
        default=5.0, ge=0, description="Seconds `GET /v1/models` is answered from cache."
    )
    forward_client_authorization: bool = Field(
        default=False,
        description="Pass the client's `Authorization` upstream to backends without a key of their own.",
    )

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
        srv = any(b.discover == "srv" for pool in self.pools.values() for b in pool.backends.values())
        if (srv or self.discovery.nameservers) and importlib.util.find_spec("dns") is None:
            raise ValueError("discover: srv and discovery.nameservers need dnspython: pip install 'specroute[dns]'")
        if self.tracing.enabled and importlib.util.find_spec("opentelemetry.sdk") is None:
            raise ValueError("tracing needs the OpenTelemetry SDK: pip install 'specroute[otel]'")
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
    for group in data["fairness"]["groups"].values():
        env = group["keys_env"]
        count = len([k for k in os.environ.get(env, "").split(",") if k.strip()])
        group["keys_env"] = f"{env} ({count} keys)"
    url = data["state"]["redis_url"]
    if url and "@" in url:
        data["state"]["redis_url"] = "{}//***@{}".format(url.split("//", 1)[0], url.rsplit("@", 1)[1])
    env = data["batch"]["postgres_dsn_env"]
    if env:
        data["batch"]["postgres_dsn_env"] = f"{env} ({'set' if os.environ.get(env) else 'NOT SET'})"
    for rule in data["classify"]["rules"]:
        if rule["match"]["api_key"] is not None:
            rule["match"]["api_key"] = "***"
    return data
