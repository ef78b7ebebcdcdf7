"""Forwarding, the third stage: an attempt loop over the retry plan, to a response or an error.

Each attempt takes a slot on a backend of the decided pool (waiting in its queue if need be),
sends the request, and judges what came back before any byte has gone to the client:

- an answer to relay (a stream has started, or a whole answer was read): `Answer`, holding
  the slot until the relay is done (`Forwarder.release`);
- a failure that another backend may not share (no connection, a 502/503/504, no answer in
  time, a broken body): tried again on another backend of the pool, then on another pool,
  while `retries.attempts`, `retries.deadline` and the retry budget allow. When none allows,
  an engine's own answer goes to the client as it is (its 503 and body), and a failure without
  one becomes the router's error (`Failure`).

This is also the one place where the transport's exceptions become the router's errors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from router.backends.backend import Backend
from router.backends.pools import Pool, Pools
from router.clock import Clock
from router.errors import NoBackendAvailable, RouterError, UpstreamError, UpstreamTimeout
from router.replicas.shared import Replicas
from router.request.decide import Routed, with_field
from router.request.headers import request_headers
from router.request.incoming import Incoming
from router.request.observe import Observer
from router.request.plan import Plan
from router.routing.policy import Decision
from router.routing.snapshot import prefill_seconds
from router.transport import (
    ConnectError,
    NotSent,
    ReadTimeout,
    Response,
    TlsError,
    TooLarge,
    Transport,
    TransportError,
    WrongAnswer,
)

logger = logging.getLogger("specroute")

# Upstream answers that mean "not now, try elsewhere" (RFC 9110 §15.6), retried before the first byte.
_RETRYABLE_STATUS = frozenset({502, 503, 504})
# Requests sent again to the same backend when the engine had closed the pooled connection before
# any byte was written (NotSent). Each such attempt discards one closed connection; more in a
# row mean the engine closes connections as they open, a failure like any other.
_NOT_SENT_RESENDS = 3


@dataclass(frozen=True, slots=True)
class Attempts:
    """What the attempts of one request came to, for its answer headers and its record."""

    decision: Decision  # the last pool tried (`failover:<first pool>` when it changed)
    backend: Backend | None  # the last backend tried
    count: int  # requests sent upstream
    queue_wait: float  # seconds in pool queues, over all attempts
    concurrency: int = 0  # requests on the last backend when this one was sent, itself included


@dataclass(frozen=True, slots=True)
class Answer:
    """An engine's answer to relay; its backend's slot is held until `Forwarder.release`."""

    attempts: Attempts
    backend: Backend
    pool: Pool
    response: Response
    content: bytes | None  # the whole body; None: an event stream, relayed as it arrives


@dataclass(frozen=True, slots=True)
class Failure:
    attempts: Attempts
    error: RouterError


@dataclass(frozen=True, slots=True)
class _Reply:
    """What one backend answered, before any byte reached the client."""

    response: Response
    content: bytes | None  # the whole body; None: an event stream


@dataclass(frozen=True, slots=True)
class _Failed:
    """One attempt that failed before any byte reached the client."""

    error: UpstreamError
    reason: str  # why, for the retry counter: a transport failure's kind, or http_<status>
    retryable: bool
    response: Response | None = None  # the engine's own answer, if it gave one


@dataclass(frozen=True, slots=True)
class _Retry:
    """Go again, to `pool`: the failed attempt's slot is given back."""

    backend: Backend
    reason: str
    pool: str


class _Route:
    """Where one request's attempts went so far: the state the retry loop carries."""

    def __init__(self, routed: Routed, pools: Pools, deadline: float) -> None:
        self.decision = routed.decision
        self.deadline = deadline  # no new attempt starts after it
        # A request pinned to one backend (router.affinity) may go to no other.
        self.tried = {b.name for b in pools.backends() if b.name != routed.backend} if routed.backend else set()
        self.count = 0
        self.queue_wait = 0.0
        self.backend: Backend | None = None

    def attempts(self, concurrency: int = 0) -> Attempts:
        return Attempts(self.decision, self.backend, self.count, self.queue_wait, concurrency)


class Forwarder:
    def __init__(
        self, pools: Pools, transport: Transport, observer: Observer, clock: Clock, replicas: Replicas
    ) -> None:
        self._pools = pools
        self._replicas = replicas
        self._transport = transport
        self._observer = observer
        self._clock = clock
        self._retrying = 0  # attempts under way that are retries, for the retry budget

    async def forward(
        self, incoming: Incoming, routed: Routed, plan: Plan, noted: Callable[[Attempts], None]
    ) -> Answer | Failure:
        """`noted` hears of each attempt as it is sent: a request ended under way (its client
        gone) is still counted against the backend it was on."""
        route = _Route(routed, self._pools, self._clock.now() + plan.retries.deadline)
        while True:
            step = await self._on_pool(incoming, routed, plan, route, noted)
            if not isinstance(step, _Retry):
                return step
            self._observer.retried(step.backend, step.reason)
            if step.pool != route.decision.pool:
                # The first token predicted was the first pool's.
                route.decision = replace(
                    route.decision, pool=step.pool, reason=f"failover:{routed.decision.pool}", predicted_ttft=None
                )

    async def _on_pool(
        self, incoming: Incoming, routed: Routed, plan: Plan, route: _Route, noted: Callable[[Attempts], None]
    ) -> Answer | Failure | _Retry:
        """One attempt: a slot on a backend of the route's pool, the request, and its judgement."""
        pool = self._pools.get(route.decision.pool)
        if pool is None:  # removed by a reload while this request waited to be retried
            error = NoBackendAvailable(f"pool {route.decision.pool!r} is no longer configured", code="pool_unavailable")
            return Failure(route.attempts(), error)
        try:
            backend = await self._acquire(incoming, routed, plan, route, pool)
        except NoBackendAvailable as exc:
            return Failure(route.attempts(), exc)
        attempts = route.attempts(backend.concurrency(self._clock.now(), plan.stale_after))
        noted(attempts)
        try:
            result = await self._attempt(incoming, routed, plan, backend, retry=route.count > 1)
            target = self._retry_target(result, route, plan) if isinstance(result, _Failed) else None
            if isinstance(result, _Failed) and target is None and result.response is not None:
                # No retry left: the engine's own last answer goes to the client as it is.
                result = await self._whole_or_stream(incoming, plan, backend, result.response)
            if isinstance(result, _Reply):
                return Answer(attempts, backend, pool, result.response, result.content)
        except BaseException:  # the client left, or the router is ending it
            self._release(incoming, pool, backend)
            raise
        if result.response is not None:
            await result.response.aclose()
        self._release(incoming, pool, backend)
        if target is None:
            return Failure(attempts, result.error)
        return _Retry(backend, result.reason, target)

    async def _acquire(self, incoming: Incoming, routed: Routed, plan: Plan, route: _Route, pool: Pool) -> Backend:
        """A slot on a backend of `pool`, waiting in its queue if need be. A retry goes to none
        tried; a pinned request waits for its one backend like any other."""
        queued_at = self._clock.now()
        exclude = frozenset(route.tried) if route.count else frozenset()
        tokens = incoming.prompt.total
        while True:
            backend = await pool.acquire(
                route.decision.job,
                client=incoming.client,
                weight=plan.groups.weight(incoming.group),
                exclude=exclude,
                only=routed.backend,
                prefer=None if route.count else routed.prefer,  # where its prompt's prefix is cached
                # Its KV size matters only for room over a full pool's cap (router.backends.newcomers).
                tokens=None if pool.has_other(exclude) else tokens,
            )
            # A slot the other replicas (router.replicas) took meanwhile is given back, and the
            # request waits for another.
            try:
                if await self._replicas.claim(backend, incoming.client):
                    break
            except BaseException:
                pool.give_back(backend, client=incoming.client)
                self._replicas.released(backend)
                raise
            pool.give_back(backend, client=incoming.client)
        now = self._clock.now()
        self._observer.queued(pool.name, route.decision, now - queued_at)
        route.queue_wait += now - queued_at
        route.count += 1
        route.tried.add(backend.name)
        route.backend = backend
        if tokens is not None:  # the KV it takes there, for the next request's projection
            backend.holding[id(incoming)] = tokens
        if route.decision.job == "batch":  # a conversation's answer there would slow it (router.routing.policy)
            backend.batch_work.add(id(incoming))
        if incoming.stream:  # shows in the live view while it waits; its prefill queues there
            backend.first_tokens.waiting(id(incoming), now, _prefill(routed, backend, plan))
        return backend

    def _retry_target(self, failed: _Failed, route: _Route, plan: Plan) -> str | None:
        """Where the next attempt goes, if anything allows one: the count, the deadline, the budget."""
        if not failed.retryable:
            return None
        target = self._next_pool(route.decision, frozenset(route.tried), plan)
        allowed = route.count < plan.retries.attempts and self._clock.now() < route.deadline
        return target if allowed and self._budget_allows(plan) else None

    def release(self, incoming: Incoming, answer: Answer) -> None:
        self._release(incoming, answer.pool, answer.backend)

    def _release(self, incoming: Incoming, pool: Pool, backend: Backend) -> None:
        backend.first_tokens.forget(id(incoming))
        backend.holding.pop(id(incoming), None)
        backend.batch_work.discard(id(incoming))
        pool.release(backend, client=incoming.client, duration=self._clock.now() - incoming.arrival.started)
        self._replicas.released(backend)

    async def _attempt(
        self, incoming: Incoming, routed: Routed, plan: Plan, backend: Backend, *, retry: bool
    ) -> _Reply | _Failed:
        self._retrying += retry
        try:
            return await self._send(incoming, routed, plan, backend)
        finally:
            self._retrying -= retry

    def _prioritized(self, incoming: Incoming, routed: Routed, backend: Backend) -> bytes:
        """The body, with the `priority` its pool's engines schedule by if they do (router.backends.pools)."""
        pool = self._pools.get(backend.pool)
        if pool is None or not pool.priority_scheduling or not incoming.payload:
            return routed.body
        decision = routed.decision
        last = incoming.internal or decision.reason.startswith("borrow:")
        priority = pool.priority(decision.job, incoming.client, last=last)
        return with_field(routed.body, "priority", priority, absent="priority" not in incoming.payload)

    async def _send(self, incoming: Incoming, routed: Routed, plan: Plan, backend: Backend) -> _Reply | _Failed:
        headers = request_headers(
            incoming.headers,
            drop=plan.override_headers,
            request_id=incoming.arrival.request_id,
            api_key=backend.api_key,
            forward_authorization=plan.forward_authorization,
            trace=routed.trace,
        )
        try:
            arrival = incoming.arrival
            body = self._prioritized(incoming, routed, backend)
            response = await self._request(backend, arrival.method, arrival.target, headers, body, plan)
        except TransportError as exc:
            return self._failed(backend, exc)
        status = response.status
        if status in _RETRYABLE_STATUS:
            reason = f"http_{status}"
            self._observer.upstream_error(backend, reason)
            backend.outlier.request_failed(self._clock.now())
            return _Failed(UpstreamError(f"backend {backend.name!r} answered {status}"), reason, True, response)
        if status >= 500:
            self._observer.upstream_error(backend, "http_5xx")
        else:
            backend.outlier.request_succeeded()
        return await self._whole_or_stream(incoming, plan, backend, response)

    async def _request(
        self, backend: Backend, method: str, target: str, headers: list[tuple[str, str]], body: bytes, plan: Plan
    ) -> Response:
        """The request to `backend`, until its response head. One the transport could not write at
        all (NotSent: the engine had closed the pooled connection first) goes to the same backend
        again at once, pinned or not and outside the retry budget: the engine never saw it. Each
        is counted in `specroute_retries_total` (reason `not_sent`)."""
        resends = 0
        while True:
            try:
                return await self._transport.request(
                    backend.url,
                    target,
                    method=method,
                    headers=headers,
                    body=body,
                    timeouts=plan.timeouts,
                    limits=plan.head_limits,
                )
            except NotSent:
                if resends == _NOT_SENT_RESENDS:
                    raise
                resends += 1
                self._observer.retried(backend, "not_sent")

    async def _whole_or_stream(
        self, incoming: Incoming, plan: Plan, backend: Backend, response: Response
    ) -> _Reply | _Failed:
        """An event stream goes on as it arrives; anything else is read whole first, while a
        failure may still be tried elsewhere. What the engine answers decides, not what the body
        said: a multipart upload's `stream=true` (audio transcriptions) is never read here."""
        if (response.header(b"content-type") or b"").startswith(b"text/event-stream"):
            if not incoming.stream:  # a stream the router could not foresee: its first token from now
                backend.first_tokens.waiting(id(incoming), self._clock.now())
            return _Reply(response, None)
        try:
            return _Reply(response, await response.read(limit=plan.response_body_bytes))
        except TransportError as exc:
            await response.aclose()
            return self._failed(backend, exc)
        except BaseException:
            await response.aclose()
            raise

    def _failed(self, backend: Backend, exc: TransportError) -> _Failed:
        error, kind = self.upstream_failure(backend, exc)
        backend.outlier.request_failed(self._clock.now())
        # Too large for one engine is too large for any: another would not be asked less.
        return _Failed(error, kind, retryable=not isinstance(exc, TooLarge))

    def upstream_failure(self, backend: Backend, exc: TransportError) -> tuple[UpstreamError, str]:
        """The one place where the transport's exceptions become the router's: (error, kind)."""
        error: UpstreamError
        if isinstance(exc, TlsError):
            kind = "tls"
            error = UpstreamError(f"backend {backend.name!r}: {exc}", code="upstream_tls")
            logger.warning("backend %r: %s", backend.name, exc)
        elif isinstance(exc, ConnectError):
            kind = "connect"
            error = UpstreamError(f"backend {backend.name!r} is unreachable", code="upstream_unreachable")
        elif isinstance(exc, ReadTimeout):
            kind = "timeout"
            error = UpstreamTimeout(f"backend {backend.name!r} timed out", code="upstream_timeout")
        elif isinstance(exc, WrongAnswer):
            kind = "wrong_answer"
            error = UpstreamError(f"backend {backend.name!r} answered another request", code="upstream_failed")
            logger.warning("backend %r: %s; the connection is closed", backend.name, exc)
        else:
            kind = "protocol"
            # The limit broken is ours to name; aiohttp's own messages may quote the engine's bytes.
            reason = str(exc) if isinstance(exc, TooLarge) else type(exc).__name__
            error = UpstreamError(f"backend {backend.name!r} failed: {reason}", code="upstream_failed")
        self._observer.upstream_error(backend, kind)
        return error, kind

    def _budget_allows(self, plan: Plan) -> bool:
        """The retry budget: a share of the requests in flight, and always a few."""
        config = plan.retries
        in_flight = sum(pool.in_flight for pool in self._pools)
        return self._retrying < max(config.min_concurrent, config.budget * in_flight)

    def _next_pool(self, decision: Decision, tried: frozenset[str], plan: Plan) -> str | None:
        """Where a retry would go: another backend of the same pool, else another pool."""
        pool = self._pools.get(decision.pool)
        if pool is not None and pool.has_other(tried):
            return decision.pool
        if not plan.retries.cross_pool or decision.reason in ("pinned", "response_affinity"):
            return None
        return next((pool.name for pool in self._pools if pool.has_other(tried)), None)


def _prefill(routed: Routed, backend: Backend, plan: Plan) -> float:
    """Seconds the request's uncached prompt takes to prefill on `backend` (0: not placed by conversation)."""
    if routed.prompt is None:
        return 0.0
    uncached = routed.prompt.tokens - routed.held.get(backend.name, 0)
    return prefill_seconds(backend, uncached, plan.conversations.prefill_token_seconds)
