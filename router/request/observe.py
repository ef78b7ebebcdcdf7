"""Observation, the last stage: the one place the request path records what happened.

Metrics as they happen (a decision, a queue wait, an upstream failure or retry, a first token:
a queue shows while it builds), and once a request has ended, from its `Finished` record: the
request counters and histograms, the tokens, the speed its user saw (learned per backend),
the access log line, and the request's entry in the traffic record (router.traffic).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from router import logs
from router.backends.backend import Backend
from router.metrics import Children, Metrics
from router.record import Served, conversation_hash
from router.request.incoming import Arrival
from router.routing.learn import SpeedModel
from router.routing.policy import Decision
from router.traffic import TrafficRecorder

access_log = logging.getLogger("specroute.access")


@dataclass(frozen=True, slots=True)
class Finished:
    """One request at its end, whatever became of it."""

    arrival: Arrival
    duration: float  # seconds from arrival to the last byte
    status: int
    code: str | None  # the router's error code, when it answered or ended the request with one
    model: str | None  # as the client named it
    client: str | None
    decision: Decision | None
    backend: Backend | None
    attempts: int = 0  # sent upstream this many times (1 + retries)
    queue_wait: float = 0.0  # seconds in pool queues, over all attempts
    concurrency: int = 0  # requests on the backend when this one was sent, itself included
    ttft: float | None = None
    tokens: int | None = None
    prompt_tokens: int | None = None
    accept_length: float | None = None  # the backend's speculative gain when it ended
    conversation: str | None = None  # its session header or the stored response it continues
    declared: bool = False  # the client named its job type in the job header
    streamed: bool = False  # the client asked for a stream


class Observer:
    def __init__(self, metrics: Metrics, speeds: SpeedModel, traffic: TrafficRecorder) -> None:
        self._metrics = metrics
        self._speeds = speeds
        self._traffic = traffic
        # Each metric's children by label values, resolved once (router.metrics.Children).
        self._decisions = Children(metrics.decisions)
        self._queue_wait = Children(metrics.queue_wait)
        self._upstream_errors = Children(metrics.upstream_errors)
        self._locates = Children(metrics.locates)
        self._placements = Children(metrics.placements)
        self._retries = Children(metrics.retries)
        self._ttft = Children(metrics.ttft)
        self._requests = Children(metrics.requests)
        self._duration = Children(metrics.duration)
        self._tpot = Children(metrics.tpot)
        self._completion_tokens = Children(metrics.completion_tokens)
        self._prompt_tokens = Children(metrics.prompt_tokens)
        self._prediction_error = Children(metrics.prediction_error)
        self._ttft_target = Children(metrics.ttft_target)

    def forget(self, backend: str) -> None:
        """Drop the series of a backend removed for good (router.backends.discovery): those
        labelled with it, each second after `pool`; a pool or class of the same name keeps its own."""
        for children in (
            self._upstream_errors,
            self._retries,
            self._ttft,
            self._requests,
            self._duration,
            self._tpot,
            self._completion_tokens,
            self._prompt_tokens,
        ):
            children.forget(backend, at=1)

    def decided(self, decision: Decision) -> None:
        self._decisions(decision.job, decision.pool, decision.reason, decision.content).inc()

    def queued(self, pool: str, decision: Decision, waited: float) -> None:
        self._queue_wait(pool, decision.job).observe(waited)

    def upstream_error(self, backend: Backend, kind: str) -> None:
        self._upstream_errors(backend.pool, backend.name, kind).inc()

    def placed(self, pool: str, placed: str) -> None:
        """A request with a prompt took a backend: the one holding its prefix (`prefix`), another
        (`elsewhere`), or no backend of the pool held any of it (`new`)."""
        self._placements(pool, placed).inc()

    def located(self, result: str) -> None:
        self._locates(result).inc()

    def retried(self, backend: Backend, reason: str) -> None:
        self._retries(backend.pool, backend.name, reason).inc()

    def first_token(
        self, decision: Decision, backend: Backend, model: str | None, ttft: float, token: object, *, target: float
    ) -> None:
        """A stream's first token, `ttft` seconds after arrival; `target`: routing.ttft_target."""
        self._ttft(decision.pool, backend.name, decision.job, self._metrics.model(model)).observe(ttft)
        backend.first_tokens.arrived(token, ttft)
        # How well routing predicted it (docs/metrics.md, "Prediction accounting").
        if decision.predicted_ttft is not None:
            self._prediction_error(decision.pool).observe(ttft - decision.predicted_ttft)
        if decision.job == "interactive":
            self._ttft_target(decision.pool, "within" if ttft <= target else "late").inc()

    def finished(self, done: Finished) -> None:
        metrics = self._metrics
        decision, backend = done.decision, done.backend
        pool = decision.pool if decision else ""
        name = backend.name if backend else ""
        job = decision.job if decision else ""
        model = metrics.model(done.model)
        labels = (pool, name, job, model)
        self._requests(*labels, str(done.status), done.code or "").inc()
        if done.streamed and done.ttft is None and decision is not None and decision.job == "interactive":
            self._ttft_target(pool, "none").inc()
        self._duration(*labels).observe(done.duration)
        if backend is not None and decision is not None:
            if done.tokens:
                self._completion_tokens(pool, name, model).inc(done.tokens)
                elapsed = done.duration - done.ttft if done.ttft is not None else 0.0
                if elapsed > 0 and done.tokens > 1 and done.status < 400:
                    self._tpot(*labels).observe(elapsed / (done.tokens - 1))
                    self._speeds.observe(
                        backend.name,
                        decision.content,
                        concurrency=done.concurrency,
                        speed=(done.tokens - 1) / elapsed,
                        tokens=done.tokens,
                        gain=done.accept_length,
                    )
            if done.prompt_tokens:
                self._prompt_tokens(pool, name, model).inc(done.prompt_tokens)
        if self._traffic.enabled and decision is not None and done.status < 400:
            self._traffic.add(served(done, at=self._traffic.wall(done.arrival.started)))
        if access_log.isEnabledFor(logging.INFO):
            fields = access_fields(done)
            access_log.info(logs.key_values(fields), extra={"fields": fields})


def access_fields(done: Finished) -> dict[str, str | int | None]:
    """What the access log says of a request: never a prompt, a completion or a key."""
    decision = done.decision
    return {
        "id": done.arrival.request_id,
        "path": done.arrival.path,
        "model": done.model,
        "client": logs.client_hash(done.client) if done.client else None,
        "job": decision.job if decision else None,
        "reason": decision.reason if decision else None,
        "pool": decision.pool if decision else None,
        "backend": done.backend.name if done.backend else None,
        "status": done.status,
        "code": done.code,
        "retries": max(done.attempts - 1, 0),
        "queue_ms": round(done.queue_wait * 1000),
        "ttft_ms": round(done.ttft * 1000) if done.ttft is not None else None,
        "tokens": done.tokens,
        "duration_ms": round(done.duration * 1000),
    }


def served(done: Finished, *, at: float) -> Served:
    """A request's entry in the traffic record: sizes and hashes, never its text."""
    decision = done.decision
    assert decision is not None
    return Served(
        at=at,
        job=decision.job,
        kind=decision.content,
        prompt_tokens=done.prompt_tokens or 0,
        answer_tokens=done.tokens or 0,
        status=done.status,
        client=logs.client_hash(done.client) if done.client else None,
        conversation=conversation_hash(done.conversation) if done.conversation else None,
        declared=done.declared,
        ttft=done.ttft,
        duration=done.duration,
    )
