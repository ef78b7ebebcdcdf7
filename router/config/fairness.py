"""How a contended pool is shared between clients: fair share and its weights."""

from __future__ import annotations

from pydantic import Field

from router.config.base import Section


class Quota(Section):
    """Limits on one client, one key or one key group; unset: no limit."""

    requests_per_minute: int | None = Field(
        default=None, ge=1, description="Requests a minute; past it, 429 `rate_limit_exceeded` (type `requests`)."
    )
    tokens_per_minute: int | None = Field(
        default=None,
        ge=1,
        description="Tokens a minute, the prompt's (estimated on arrival, then as the engine counts it) and the "
        "answer's (once known); past it, 429 `rate_limit_exceeded` (type `tokens`).",
    )
    max_in_flight: int | None = Field(
        default=None, ge=1, description="Requests in flight at once; one more: 429 `rate_limit_exceeded`."
    )

    @property
    def limited(self) -> bool:
        return any(v is not None for v in (self.requests_per_minute, self.tokens_per_minute, self.max_in_flight))


class KeyGroup(Quota):
    """Clients that share a weight and limits: the keys in one environment variable."""

    keys_env: str = Field(
        description="Name of the environment variable holding the group's API keys (comma-separated), never the "
        "keys themselves. A request with one of them belongs to the group."
    )
    weight: float = Field(
        default=1.0,
        gt=0,
        description="The group's clients' share of a contended pool against others: a client of weight 2 is "
        "admitted as if it held half the slots it holds.",
    )
    shared: bool = Field(
        default=False,
        description="The group's limits hold for all its keys together (true) or for each key on its own (false).",
    )


class Fairness(Section):
    """How a contended pool is shared between clients (router.backends.pools)."""

    fair_share: bool = Field(
        default=True,
        description="Order each pool's queue fairly within a job class: a freed slot goes to the waiting request "
        "whose client holds the fewest slots for its weight (false: first come, first served).",
    )
    keep_room: bool = Field(
        default=True,
        description="While other clients are active on a pool, a client holding at least its share of the slots "
        "(the pool's slots times its weight over the active clients' weights) takes one more only if a slot stays "
        "free for each other active client holding none; else it waits in the queue "
        "(`specroute_held_back_requests_total`). Alone on a pool, a client takes every slot. With `fair_share` only.",
    )
    active_window: float = Field(
        default=30.0,
        gt=0,
        description="Seconds a client counts as active on a pool after it last asked for or gave back a slot there "
        "(`keep_room`); one holding a slot is active. About the time its users read an answer before asking again.",
    )
    newcomer_slots: int = Field(
        default=8,
        ge=0,
        le=1024,
        description="Requests over a backend's `max_concurrency` it may run for interactive requests whose client "
        "holds no slot in the pool, when every slot is taken: only while the engine's last fresh reading shows KV "
        "room for one more (below `routing.kv_threshold`) and no other replica uses the backend "
        "(`specroute_newcomer_requests_total`). A client that took every slot before others asked then does not "
        "make them wait for one of its requests to end. 0: never over the cap. With `fair_share` only.",
    )
    top_clients: int = Field(
        default=10,
        ge=0,
        le=100,
        description="How many clients, those holding the most slots of a pool, /metrics and /router/status show "
        "by name (a hash); the rest are summed as `others`.",
    )
    groups: dict[str, KeyGroup] = Field(
        default={}, description="Groups of API keys by name, each with its weight in the fair share and its limits."
    )
    default_limits: Quota = Field(
        default=Quota(),
        description="Limits on each client in no group (each its own: a key, a `user`, an address).",
    )
