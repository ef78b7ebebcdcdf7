"""The Responses API stage of the request path: a request naming a stored response goes to the
backend that holds it, and an answer that makes (or deletes) one is noted.

    route  after decide:  Routed -> Routed pinned to the owner (`reason="response_affinity"`),
                          the one remembered (router.affinity), else the one found by asking
                          the healthy backends (router.locate); as decided if held nowhere;
                          404 if remembered as made with another client key (client keys set)
    note   after relay:   a new response's id -> the backend and client that made it; a DELETE
                          forgets it

Most requests name no stored response: `route` costs them one comparison (`response_ref`).
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

from router.backends.backend import Backend
from router.backends.pools import Pools
from router.clock import Clock
from router.errors import NotFound
from router.request.decide import Routed
from router.request.forward import Answer
from router.request.headers import request_headers
from router.request.incoming import Incoming
from router.request.observe import Observer
from router.request.plan import Plan
from router.request.relay import Outcome
from router.responses.affinity import ResponseAffinity, made_response, response_ref
from router.responses.locate import Locator


class StoredResponses:
    def __init__(
        self, *, pools: Pools, owners: ResponseAffinity, locator: Locator, observer: Observer, clock: Clock
    ) -> None:
        self._pools = pools
        self._owners = owners
        self._locator = locator
        self._observer = observer
        self._clock = clock

    async def route(self, incoming: Incoming, routed: Routed, plan: Plan) -> Routed:
        """A request naming a stored response goes to the backend that holds it: the one
        remembered, else the one found by asking the healthy backends (router.locate)."""
        arrival = incoming.arrival
        ref = response_ref(arrival.method, arrival.path, incoming.payload)
        if ref is None:
            return routed
        now = self._clock.now()
        name = self._owners.owner(ref, now)
        maker = self._owners.maker(ref) if name is not None and plan.auth.required else None
        if maker is not None and not incoming.internal and maker != _client(incoming):
            # Made here with another client key: an engine sent the backend's key (or none) cannot tell.
            raise NotFound(f"Response with id '{ref}' not found.", code="response_not_found")
        if name is None:
            name = await self._locate(incoming, ref, plan)
            if name is not None:
                self._owners.remember(ref, name, self._clock.now())
        owner = next((b for b in self._pools.backends() if b.name == name), None) if name is not None else None
        if owner is None:
            return routed  # held nowhere that answered, or no longer configured: as usual
        # Pinned to one backend: the pool's predicted first token (its best backend's) is not its.
        decision = replace(routed.decision, pool=owner.pool, reason="response_affinity", predicted_ttft=None)
        return replace(routed, decision=decision, backend=owner.name)

    async def _locate(self, incoming: Incoming, ref: str, plan: Plan) -> str | None:
        def headers(backend: Backend) -> list[tuple[str, str]]:
            # What the request itself would carry there (its key or the backend's), under its own id.
            return request_headers(
                incoming.headers,
                drop=plan.override_headers,
                request_id=f"{incoming.arrival.request_id}-locate",
                api_key=backend.api_key,
                forward_authorization=plan.forward_authorization,
            )

        backends = [backend for backend in self._pools.backends() if backend.healthy]
        credentials = incoming.headers.get("authorization", "")
        name, result = await self._locator.locate(
            ref, backends, headers, credentials=credentials, now=self._clock.now()
        )
        self._observer.located(result)
        return name

    def note(self, incoming: Incoming, answer: Answer, outcome: Outcome) -> None:
        """What an answer tells of the stored responses: one made there, or one deleted."""
        arrival = incoming.arrival
        if outcome.status >= 400:
            return
        if outcome.response_id is not None and made_response(arrival.method, arrival.path):
            maker = None if incoming.internal else _client(incoming)  # a batch line's: its batch's client
            self._owners.remember(outcome.response_id, answer.backend.name, self._clock.now(), maker=maker)
        elif arrival.method == "DELETE":
            ref = response_ref(arrival.method, arrival.path, incoming.payload)
            if ref is not None:
                self._owners.forget(ref)


def _client(incoming: Incoming) -> bytes:
    """Who made or names a stored response: a digest of the client's key (no key: anonymous)."""
    key = (incoming.api_key or "").encode()
    return hashlib.blake2b(key, digest_size=16).digest()
