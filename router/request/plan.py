"""`Plan`: everything the request path needs of the settings, compiled once per (re)load.

`Router.apply` builds one from the settings and swaps it in whole; a request takes the plan
once, at its entry, and reads nothing else of the settings. So a request that straddles a
reload runs on the old settings from start to end, never on a mix.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.auth import Auth, KeyGroups
from router.config import Conversations, Retries, Routing, Settings
from router.request.decide import TtftTarget
from router.routing.classify import Classifier
from router.routing.clients import Placeholders
from router.routing.policy import Policy
from router.transport import HeadLimits, Timeouts


@dataclass(frozen=True, slots=True)
class Plan:
    auth: Auth
    classifier: Classifier
    policy: Policy
    override_headers: frozenset[str]  # lower-cased; never forwarded
    job_header: str  # lower-cased
    ttft: TtftTarget  # how a request's own first-token target is read and held
    code_hints: tuple[str, ...]
    placeholders: Placeholders  # bearer keys that identify nobody
    groups: KeyGroups  # the key groups of `fairness.groups`
    top_clients: int  # clients shown by name per pool (router.status)
    # The client's side (ingress).
    max_body_bytes: int
    json_depth: int
    client_body_seconds: float
    # The engine's side (forwarding, relay).
    timeouts: Timeouts
    head_limits: HeadLimits
    response_body_bytes: int
    sse_event_bytes: int
    forward_authorization: bool
    retries: Retries
    # How the live state is read (router.snapshot) and shown (router.status).
    routing: Routing
    interactive_pool: str
    batch_pool: str
    stale_after: float
    acceptance_max_age: float
    conversations: Conversations


def compile_plan(settings: Settings) -> Plan:
    timeouts, limits = settings.timeouts, settings.limits
    interactive, batch = settings.pool_for("interactive"), settings.pool_for("batch")
    return Plan(
        auth=Auth(settings.auth),
        classifier=Classifier(
            settings.classify,
            pool_header=settings.headers.pool,
            job_header=settings.headers.job,
            pools=frozenset(settings.pools),
        ),
        policy=Policy(
            settings.routing, interactive_pool=interactive, batch_pool=batch, conversations=settings.conversations
        ),
        override_headers=frozenset({settings.headers.pool.lower(), settings.headers.job.lower()}),
        job_header=settings.headers.job.lower(),
        ttft=TtftTarget(
            header=settings.headers.ttft_target.lower(),
            low=settings.routing.ttft_target_min,
            high=settings.routing.ttft_target_max,
            reject_unmeetable=settings.routing.reject_unmeetable_ttft,
        ),
        code_hints=tuple(settings.classify.code_hints),
        placeholders=Placeholders(settings.classify.placeholder_keys),
        groups=KeyGroups(settings.fairness.groups),
        top_clients=settings.fairness.top_clients,
        max_body_bytes=settings.max_body_bytes,
        json_depth=limits.json_depth,
        client_body_seconds=timeouts.client_body,
        timeouts=Timeouts(connect=timeouts.connect, read=timeouts.read, idle=timeouts.idle),
        head_limits=HeadLimits(head_bytes=limits.response_head_bytes, headers=limits.response_headers),
        response_body_bytes=limits.response_body_bytes,
        sse_event_bytes=limits.sse_event_bytes,
        forward_authorization=settings.forward_client_authorization,
        retries=settings.retries,
        routing=settings.routing,
        interactive_pool=interactive,
        batch_pool=batch,
        stale_after=settings.scrape.stale_after,
        acceptance_max_age=settings.scrape.acceptance_max_age,
        conversations=settings.conversations,
    )
