"""Prometheus metrics around a CollectorRegistry that the caller owns.

Counters and histograms are updated on the request path. Gauges of live state (in flight,
queued, healthy) are read from the pools at scrape time, so they can never drift from it.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.classify import JOB_CLASSES
from router.pools import Pools

# First tokens range from tens of milliseconds (idle speculative engine) to minutes (the
# note's 238 s queue); time per output token from ~5 ms to ~1 s.
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 20, 30, 60, 120, 240, 480)
TPOT_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1)
QUEUE_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self, registry: CollectorRegistry, pools: Pools) -> None:
        self.registry = registry
        self.requests = Counter(
            "specroute_requests",
            "Requests answered, by pool, backend, job class and HTTP status.",
            ["pool", "backend", "job", "status"],
            registry=registry,
        )
        self.ttft = Histogram(
            "specroute_time_to_first_token_seconds",
            "From arrival at the router to the first chunk carrying generated content.",
            ["pool", "backend"],
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.tpot = Histogram(
            "specroute_time_per_output_token_seconds",
            "Mean time between output tokens after the first, per request.",
            ["pool", "backend"],
            buckets=TPOT_BUCKETS,
            registry=registry,
        )
        self.queue_wait = Histogram(
            "specroute_queue_wait_seconds",
            "Time a request waited in the router's pool queue for a backend slot.",
            ["pool", "job"],
            buckets=QUEUE_BUCKETS,
            registry=registry,
        )
        self.completion_tokens = Counter(
            "specroute_completion_tokens",
            "Completion tokens delivered, as reported in the engine's usage.",
            ["pool", "backend"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "specroute_prompt_tokens",
            "Prompt tokens processed, as reported in the engine's usage.",
            ["pool", "backend"],
            registry=registry,
        )
        self.upstream_errors = Counter(
            "specroute_upstream_errors",
            "Failures talking to a backend, by kind.",
            ["pool", "backend", "kind"],
            registry=registry,
        )
        self.decisions = Counter(
            "specroute_route_decisions",
            "Routing decisions by job class, pool and reason.",
            ["job", "pool", "reason"],
            registry=registry,
        )
        registry.register(_LiveState(pools))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _LiveState(Collector):
    def __init__(self, pools: Pools) -> None:
        self._pools = pools

    def collect(self) -> Iterable[Metric]:
        in_flight = GaugeMetricFamily(
            "specroute_in_flight_requests",
            "Requests sent to a backend and not yet finished.",
            labels=["pool", "backend"],
        )
        healthy = GaugeMetricFamily(
            "specroute_backend_healthy",
            "1 if the backend passed its last health check, else 0.",
            labels=["pool", "backend"],
        )
        queued = GaugeMetricFamily(
            "specroute_queued_requests",
            "Requests waiting in the router's queue of a pool for a backend slot.",
            labels=["pool", "job"],
        )
        for pool in self._pools:
            for backend in pool.backends:
                in_flight.add_metric([pool.name, backend.name], backend.in_flight)
                healthy.add_metric([pool.name, backend.name], float(backend.healthy))
            for job in JOB_CLASSES:
                queued.add_metric([pool.name, job], pool.queued(job))
        yield in_flight
        yield healthy
        yield queued
