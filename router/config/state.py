"""What router replicas share (router.replicas)."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from router.config.base import Section


class State(Section):
    """The state router replicas share through Redis (the `redis` extra): each client's requests
    in flight and remembered peak, each backend's slots and requests sent since its reading. Read
    at start."""

    redis_url: str | None = Field(
        default=None,
        description="The Redis the replicas share (`redis://`, `rediss://` or `unix://`; a password in it is "
        "shown as `***`). Unset: each replica decides from what it alone has seen.",
    )
    key_prefix: str = Field(
        default="specroute",
        min_length=1,
        max_length=64,
        description="The prefix of every key in Redis: routers with another prefix share nothing with these.",
    )
    timeout: float = Field(
        default=0.05,
        gt=0,
        le=1,
        description="Seconds a request waits for Redis at most, per call (when it takes a slot; and when its client "
        "was not seen lately, before it is classified), the event loop's own delays included; past it, the replica "
        "decides alone until Redis answers its next sync.",
    )
    sync_interval: float = Field(
        default=0.25,
        gt=0,
        le=10,
        description="Seconds between syncs: the replica's own figures written whole, the others' read, and Redis "
        "tried again after a failure.",
    )
    ttl: float = Field(
        default=10.0,
        gt=0,
        description="Seconds after which a replica that stopped syncing (crashed, cut off) no longer counts: its "
        "figures expire. At least four sync intervals.",
    )
    lease_slots: int = Field(
        default=4,
        ge=0,
        description="Slots per backend a replica claims in Redis ahead of its requests, so that a request usually "
        "takes one without a round trip: at most this many, and at most its share of the backend's free room "
        "(free slots divided among the live replicas); held ones count as in use for the others, so nothing is "
        "over-committed. 0: every request claims its slot in a round trip.",
    )
    max_clients: int = Field(
        default=100_000,
        ge=1,
        description="Client peaks remembered in Redis at most; past it, those that fade soonest are dropped.",
    )
    max_connections: int = Field(
        default=32,
        ge=1,
        description="Connections to Redis per replica at most (a request finding none free waits within `timeout`); "
        "claims asked for at once share one round trip, so a few are in use at a time.",
    )

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must start with redis://, rediss:// or unix://")
        return value

    @model_validator(mode="after")
    def _ttl_outlives_syncs(self) -> State:
        if self.ttl < 4 * self.sync_interval:
            raise ValueError("ttl must be at least four sync intervals (a live replica would expire between syncs)")
        return self
