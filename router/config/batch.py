"""The Batch API's store and pace, and the Responses API's stored responses."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, model_validator

from router.config.base import Section


class Responses(Section):
    """The Responses API's stored responses live on the engine that made them: where they went."""

    affinity_seconds: float = Field(
        default=3600.0,
        ge=0,
        description="Seconds the router remembers which backend made a stored response (0: not at all).",
    )
    affinity_max: int = Field(
        default=100_000, ge=0, description="Response ids remembered at most; past it the oldest are forgotten first."
    )
    locate_timeout: float = Field(
        default=0.5,
        ge=0,
        description="Seconds a search for the backend holding an id the router does not remember may take (every "
        "healthy backend asked `GET /v1/responses/{id}` at once). 0: no search, routed as usual.",
    )
    locate_concurrency: int = Field(
        default=32, ge=1, description="Searches under way at once at most; past it a request is routed as usual."
    )
    locate_miss_seconds: float = Field(
        default=10.0,
        ge=0,
        description="Seconds an id every backend answered 404 for is not searched again (at most 10 000 such ids). "
        "0: always searched.",
    )


class Batch(Section):
    """The Batch API (`/v1/files`, `/v1/batches`): where its state lives and how hard it may push."""

    enabled: bool = Field(
        default=True,
        description="`false`: no Batch API of the router's own; `/v1/files` and `/v1/batches` are forwarded like any "
        "request.",
    )
    store: Literal["sqlite", "postgres"] = Field(
        default="sqlite",
        description="Where files, batches and line results live: `sqlite` (a file in `store_dir`: one replica) or "
        "`postgres` (one database several replicas share; the `postgres` extra).",
    )
    store_dir: str = Field(
        default="specroute-batches",
        description="Directory of the SQLite database, relative to the working directory; with either store, where "
        "an upload waits (unnamed) while it is checked.",
    )
    postgres_dsn_env: str | None = Field(
        default=None,
        description="With `store: postgres` (required then): the environment variable holding the connection "
        "string, never the string itself.",
    )
    max_file_bytes: int = Field(
        default=200 * 1024 * 1024,
        ge=1,
        le=1_000_000_000,
        description="Bytes of one upload; larger: 413 `file_too_large` (at most 10^9, SQLite's largest value).",
    )
    upload_timeout: float = Field(
        default=600.0,
        gt=0,
        description="Seconds a client may take to send an upload's body (then 408 `body_timeout`).",
    )
    max_storage_bytes: int = Field(
        default=10 * 1024**3,
        ge=1,
        description="Bytes the store keeps in all: files, and unfinished batches' lines with their results; past it "
        "an upload or a new batch gets 413 `storage_full`. Also the most a router's temporary copies of files being "
        "read (downloads, new batches) take at once; past it 503 `batch_copies_full`.",
    )
    max_lines: int = Field(default=50_000, ge=1, description="Requests in one input file at most.")
    max_concurrency: int = Field(
        default=64, ge=1, description="Batch lines in flight at most, whatever the pools have free."
    )
    reserve_slots: int = Field(
        default=1, ge=0, description="Slots of the standard pool that batch lines leave free for live requests."
    )
    poll_interval: float = Field(
        default=0.5,
        gt=0,
        description="Seconds between the runner's looks at the pools (concurrency, expiry, batch states).",
    )
    ttft_rise: float = Field(
        default=2.0,
        gt=1,
        description="Back off when the standard pool's recent first-token p50 is this many times its lowest.",
    )
    lease_seconds: float = Field(
        default=60.0,
        gt=0,
        description="Seconds a line taken by a router is its own (renewed while it runs); a dead router's lines are "
        "taken again after it.",
    )
    max_attempts: int = Field(
        default=5,
        ge=1,
        description="Tries in all for a line answered 429, 502, 503 or 504, or not at all; then its last answer is "
        "recorded.",
    )
    retry_backoff: float = Field(
        default=1.0, gt=0, description="Seconds before such a line is tried again, doubling each time."
    )

    @model_validator(mode="after")
    def _postgres_needs_its_dsn(self) -> Batch:
        if self.store == "postgres" and not self.postgres_dsn_env:
            raise ValueError("store postgres needs postgres_dsn_env: the environment variable holding its DSN")
        return self

    def postgres_dsn(self) -> str | None:
        return os.environ.get(self.postgres_dsn_env) if self.postgres_dsn_env else None
