"""How a contended pool is shared between clients: fair share and its weights."""

from __future__ import annotations

from pydantic import Field

from router.config.base import Section


class KeyGroup(Section):
    """Clients that share a weight: the keys in one environment variable."""

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


class Fairness(Section):
    """How a contended pool is shared between clients (router.backends.pools)."""

    fair_share: bool = Field(
        default=True,
        description="Order each pool's queue fairly within a job class: a freed slot goes to the waiting request "
        "whose client holds the fewest slots for its weight (false: first come, first served).",
    )
    top_clients: int = Field(
        default=10,
        ge=0,
        le=100,
        description="How many clients, those holding the most slots of a pool, /metrics and /router/status show "
        "by name (a hash); the rest are summed as `others`.",
    )
    groups: dict[str, KeyGroup] = Field(
        default={}, description="Groups of API keys by name, each with its weight in the fair share."
    )
