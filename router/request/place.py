"""Placement, part of the decision: a request's conversation, where its prefix is cached, and
where it went (router.routing.conversations keeps the index; the policy weighs what it finds)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from router.backends.backend import Backend
from router.backends.pools import Pools
from router.clock import Clock
from router.request.decide import Routed
from router.request.incoming import Incoming
from router.request.observe import Observer
from router.request.plan import Plan
from router.routing.conversations import Cached, ConversationIndex, Prompt
from router.routing.policy import PoolState


class Placement:
    def __init__(self, conversations: ConversationIndex, pools: Pools, observer: Observer, clock: Clock) -> None:
        self._conversations = conversations
        self._pools = pools
        self._observer = observer
        self._clock = clock

    def look_up(self, incoming: Incoming, plan: Plan, now: float) -> tuple[Prompt | None, Cached | None]:
        """The request's prompt as the index knows conversations, and which backends hold its prefix;
        (None, None) where conversations are off or the request has no prompt to place."""
        if not plan.conversations.enabled or incoming.arrival.method != "POST":
            return None, None
        prompt = self._conversations.prompt(
            incoming.payload, incoming.headers, client=incoming.client, text=incoming.prompt.text
        )
        return (prompt, self._conversations.cached(prompt, now)) if prompt is not None else (None, None)

    def placed(self, routed: Routed, backend: Backend) -> None:
        """Note where the conversation went, and whether that is where its prefix was."""
        assert routed.prompt is not None
        in_pool = {b.name: routed.held.get(b.name, 0) for b in self._pools[backend.pool].backends}
        holder = max(in_pool, key=lambda name: in_pool[name], default=None)
        if holder is None or not in_pool[holder]:
            placed = "new"
        else:
            placed = "prefix" if in_pool.get(backend.name, 0) >= in_pool[holder] else "elsewhere"
        self._observer.placed(backend.pool, placed)
        self._conversations.placed(routed.prompt, backend=backend.name, pool=backend.pool, now=self._clock.now())


def with_conversation(routed: Routed, pools: Mapping[str, PoolState], prompt: Prompt, cached: Cached) -> Routed:
    """The decision with its conversation: the backend to prefer in its pool."""
    state = pools.get(routed.decision.pool)
    prefer = state.prefer if state is not None else None
    return replace(routed, prefer=prefer, prompt=prompt, held=cached.held)


def conversation(incoming: Incoming, session_header: str) -> str | None:
    """Which conversation a request belongs to, where the client says: its session header (the
    client's own, as router.routing.conversations scopes it), or the stored response it continues."""
    session = incoming.arrival.headers.get(session_header.lower())
    if session:
        return f"session:{incoming.client} {session[:256]}"
    previous = incoming.field("previous_response_id", str)
    return f"response:{previous[:256]}" if previous else None
