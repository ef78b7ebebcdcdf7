"""Pools and their backends: the engines the router sends work to."""

from __future__ import annotations

import os
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from router.config.base import Section
from router.content import ContentKind


class Backend(Section):
    """One engine (a vLLM or SGLang server) of a pool."""

    url: str = Field(
        description="The engine's root URL, `http://` or `https://`; a trailing `/v1` is dropped. A URL with "
        "`user:pass@` is refused (the password is never printed): give the key through `api_key_env`."
    )
    api_key_env: str | None = Field(
        default=None,
        description="Name of the environment variable holding the engine's API key, never the key itself. "
        "Unset: no key is sent (or the client's, with `forward_client_authorization`).",
    )
    max_concurrency: int = Field(
        default=64, ge=1, description="Requests the router sends this backend at once; more wait in the pool's queue."
    )

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


class Pool(Section):
    """Engines serving the same model the same way: with speculative decoding or without."""

    speculative: bool = Field(description="Whether the pool's engines use speculative decoding.")
    backends: dict[str, Backend] = Field(min_length=1, description="The pool's engines, by name (unique across pools).")
    queue_size: int = Field(
        default=256,
        ge=0,
        description="Requests that may wait in the router for a slot when every backend of the pool is at "
        "`max_concurrency`; past it: 503 `queue_full` with `Retry-After`.",
    )
    queue_timeout: float = Field(
        default=30.0,
        gt=0,
        description="Seconds a request may wait in that queue; then 503 `queue_timeout` with `Retry-After`.",
    )
    priority_scheduling: bool = Field(
        default=False,
        description="The pool's engines schedule by priority (vLLM's `--scheduling-policy priority`): the router "
        "sets each request's `priority` (lower goes first), interactive work before batch work, Batch API lines "
        "and batch work borrowing the pool last, and within a class the client holding fewer of the pool's slots "
        "first. A client's own `priority` is replaced. Leave it off for engines that do not: vLLM refuses a "
        "priority other than 0 then.",
    )
    prior_speed: dict[ContentKind, dict[int, float]] = Field(
        default={},
        description="Per-user tokens/s the pool's engines give by concurrency, per content kind, e.g. "
        "`{prose: {1: 57, 4: 29.8}, code: {1: 104, 4: 42}}` (concurrencies ≥ 1, speeds > 0; a kind may be "
        "left out): the prediction before anything is learned, and what learned points are shrunk toward "
        "(`learn.prior_weight`). `specroute bench sweep` writes it as `prior-<kind>.yaml`. Empty: no prior.",
    )

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
