"""Prometheus metrics around a CollectorRegistry that the caller owns.

Counters and histograms are updated on the request path. Gauges of live state (in flight,
queued, healthy) are read from the pools at scrape time, so they can never drift from it.

No label is called `job` or `instance`: Prometheus sets those on every scraped series itself
and would rename ours to `exported_job`. The job class is `job_class`. A `model` label takes
only names the backends list or the settings name; anything else a client sends is `other`,
so a client cannot grow the number of series.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Set
from typing import Generic, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from router.backends.pools import Pools
from router.clock import Clock
from router.config import Scrape
from router.content import CONTENT_KINDS
from router.logs import client_hash
from router.routing.classify import JOB_CLASSES
from router.routing.learn import SpeedModel, crossover
from router.version import BuildInfo

# First tokens range from tens of milliseconds (idle speculative engine) to minutes (the
# note's 238 s queue); interactive targets sit between 0.2 and 3 s, so the buckets are dense
# there. Time per output token from ~5 ms to ~1 s; whole requests from 0.1 s to 10 minutes.
TTFT_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 30, 60, 120, 300)
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
TPOT_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1)
# A call to the store the replicas share: tens of microseconds on loopback, up to its timeout.
SHARED_STATE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)
QUEUE_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120)
# Actual minus predicted first token: dense within a second either way, where interactive
# targets are decided, then out to the minutes of a queue the prediction missed.
PREDICTION_ERROR_BUCKETS = (
    -60, -10, -3, -1, -0.5, -0.25, -0.1, -0.05, 0, 0.05, 0.1, 0.25, 0.5, 1, 3, 10, 60,
)  # fmt: skip


_M = TypeVar("_M", bound=MetricWrapperBase)


class Children(Generic[_M]):
    """One metric's children, each looked up once per set of label values: prometheus_client's
    `labels()` checks and converts its arguments and takes a lock on every call, which on the
    request path (several metrics a request) showed in the profile. The label values of the
    request path are bounded (pools, backends, job classes, known models, statuses), and no
    child is ever removed, so the cache neither grows without end nor goes stale."""

    __slots__ = ("_children", "_metric")

    def __init__(self, metric: _M) -> None:
        self._metric = metric
        self._children: dict[tuple[str, ...], _M] = {}

    def __call__(self, *values: str) -> _M:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child

    def forget(self, value: str, *, at: int) -> None:
        """Drop every child whose label number `at` is `value` (a backend removed for good)."""
        for values in [values for values in self._children if values[at] == value]:
            del self._children[values]
            self._metric.remove(*values)


# What a request's `model` label is when it names none, or one nobody serves.
NO_MODEL = "none"
OTHER_MODEL = "other"


class Metrics:
    def __init__(
        self,
        registry: CollectorRegistry,
        pools: Pools,
        speeds: SpeedModel,
        *,
        build: BuildInfo,
        clock: Clock,
        known_models: Callable[[], Set[str]] = frozenset,
    ) -> None:
        """`known_models()`: the model names that may be a label value (the catalog's and the
        configured ones), read at each request's end."""
        self.registry = registry
        self._known_models = known_models
        # What every Prometheus client exposes by default; a registry of our own has to ask.
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
        info = Gauge(
            "specroute_build_info",
            "Always 1; the labels say which specroute runs (version, source commit, Python).",
            ["version", "commit", "python"],
            registry=registry,
        )
        info.labels(build.version, build.commit, build.python).set(1)
        request_labels = ["pool", "backend", "job_class", "model"]
        self.requests = Counter(
            "specroute_requests",
            "Requests answered, by pool, backend, job class, model, HTTP status and the router's error code.",
            [*request_labels, "status", "code"],
            registry=registry,
        )
        self.duration = Histogram(
            "specroute_request_duration_seconds",
            "From arrival at the router to the last byte of the answer, for every request, streamed or not.",
            request_labels,
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.ttft = Histogram(
            "specroute_time_to_first_token_seconds",
            "From arrival at the router to the first chunk carrying generated content (recorded as it arrives).",
            request_labels,
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.tpot = Histogram(
            "specroute_time_per_output_token_seconds",
            "Mean time between output tokens after the first, per request.",
            request_labels,
            buckets=TPOT_BUCKETS,
            registry=registry,
        )
        self.queue_wait = Histogram(
            "specroute_queue_wait_seconds",
            "Time a request waited in the router's pool queue for a backend slot.",
            ["pool", "job_class"],
            buckets=QUEUE_BUCKETS,
            registry=registry,
        )
        self.completion_tokens = Counter(
            "specroute_completion_tokens",
            "Completion tokens delivered, as reported in the engine's usage.",
            ["pool", "backend", "model"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "specroute_prompt_tokens",
            "Prompt tokens processed, as reported in the engine's usage.",
            ["pool", "backend", "model"],
            registry=registry,
        )
        self.upstream_errors = Counter(
            "specroute_upstream_errors",
            "Failures talking to a backend, by kind.",
            ["pool", "backend", "kind"],
            registry=registry,
        )
        self.retries = Counter(
            "specroute_retries",
            "Attempts tried again elsewhere after a failure before the first byte, by the failed backend and why.",
            ["pool", "backend", "reason"],
            registry=registry,
        )
        self.decisions = Counter(
            "specroute_route_decisions",
            "Routing decisions by job class, pool, reason and content kind.",
            ["job_class", "pool", "reason", "content"],
            registry=registry,
        )
        self.locates = Counter(
            "specroute_response_locates",
            "Searches for the backend holding a stored response this router did not remember, by result.",
            ["result"],
            registry=registry,
        )
        self.placements = Counter(
            "specroute_prefix_placements",
            "Requests placed in a pool, by whether they went to the backend most likely holding their prompt's "
            "prefix (`prefix`), to another (`elsewhere`: it was past the load bound or full), or no backend there "
            "held any of it (`new`).",
            ["pool", "placed"],
            registry=registry,
        )
        self.prediction_error = Histogram(
            "specroute_ttft_prediction_error_seconds",
            "Actual minus predicted first-token time of a streamed request, by the pool the prediction was made for "
            "(positive: later than predicted). Read the buckets, not the rate of the sum: it goes down too.",
            ["pool"],
            buckets=PREDICTION_ERROR_BUCKETS,
            registry=registry,
        )
        self.ttft_target = Counter(
            "specroute_interactive_ttft_target",
            "Streamed interactive requests by pool and whether their first token came within routing.ttft_target: "
            "result within, late, or none (the request ended without one).",
            ["pool", "result"],
            registry=registry,
        )
        self.discovery_answers = Counter(
            "specroute_discovery_answers",
            "Resolutions of a backend's name (discover: dns or srv), by result: ok, failed (no answer, an error or "
            "discovery.timeout), or empty (no usable address); after failed or empty its backends are kept.",
            ["pool", "backend", "result"],
            registry=registry,
        )
        self.discovery_refused = Counter(
            "specroute_discovery_refused_addresses",
            "Addresses a name resolved to that did not become backends, by why: malformed, unusable (unspecified, "
            "multicast, link-local, reserved, port 0), network (outside discovery.networks), over_limit "
            "(past discovery.max_addresses).",
            ["pool", "backend", "why"],
            registry=registry,
        )
        self.reloads = Counter(
            "specroute_config_reloads",
            "Configuration reloads asked for (SIGHUP or /admin/reload), by result: applied or invalid.",
            ["result"],
            registry=registry,
        )
        self.shared_state_up = Gauge(
            "specroute_shared_state_up",
            "1 while this replica shares its state with the others through `state.redis_url`; 0 while it decides "
            "alone (Redis slow or down, or not configured).",
            registry=registry,
        )
        self.shared_state_fallbacks = Counter(
            "specroute_shared_state_fallbacks",
            "Times this replica turned to deciding alone because the shared state failed or ran out of time.",
            registry=registry,
        )
        self.shared_state_seconds = Histogram(
            "specroute_shared_state_seconds",
            "Time a request waited for the shared state, per call that answered: `claim` when it takes a backend's "
            "slot, `client` when a client not seen lately arrives.",
            ["call"],
            buckets=SHARED_STATE_BUCKETS,
            registry=registry,
        )
        self._live = _LiveState(pools, speeds, clock)
        registry.register(self._live)

    def configure(self, config: Scrape, *, top_clients: int = 10) -> None:
        """The (re)loaded `scrape` section: which engine readings are too old to show; and how
        many clients of each pool to show by name (`fairness.top_clients`)."""
        self._live.config = config
        self._live.top_clients = top_clients

    def model(self, name: str | None) -> str:
        """The `model` label for a requested model name: bounded, whatever the client sends."""
        if name is None:
            return NO_MODEL
        return name if name in self._known_models() else OTHER_MODEL

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _LiveState(Collector):
    def __init__(self, pools: Pools, speeds: SpeedModel, clock: Clock) -> None:
        self._pools = pools
        self._speeds = speeds
        self._clock = clock
        self.config = Scrape()
        self.top_clients = 10

    def collect(self) -> Iterable[Metric]:
        labels = ["pool", "backend"]

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=[*labels, *extra])

        in_flight = gauge("specroute_in_flight_requests", "Requests sent to a backend and not yet finished.")
        healthy = gauge("specroute_backend_healthy", "1 if the backend passed its last health check, else 0.")
        draining = gauge("specroute_backend_draining", "1 while an operator drains the backend (no new work).")
        queued = GaugeMetricFamily(
            "specroute_queued_requests",
            "Requests waiting in the router's queue of a pool for a backend slot.",
            labels=["pool", "job_class"],
        )
        running = gauge("specroute_engine_running_requests", "Requests the engine reports running (scraped).")
        waiting = gauge("specroute_engine_waiting_requests", "Requests waiting inside the engine (scraped).")
        kv = gauge("specroute_engine_kv_cache_usage_ratio", "KV cache in use, 0 to 1, as the engine reports.")
        acceptance = gauge(
            "specroute_engine_spec_acceptance_ratio",
            "Accepted / drafted speculative tokens, as last measured (kept up to scrape.acceptance_max_age).",
        )
        accept_length = gauge(
            "specroute_engine_spec_accept_length",
            "Tokens a sequence gains per step with speculation, as last measured.",
        )
        acceptance_age = gauge(
            "specroute_engine_spec_acceptance_age_seconds", "Age of the last acceptance measured (engines that draft)."
        )
        oldest_waiting = gauge(
            "specroute_oldest_waiting_first_token_seconds",
            "How long the oldest stream sent to the backend has waited for its first token (0: none waits).",
        )
        stale = gauge("specroute_engine_scrape_stale", "1 if the engine's metrics are too old to use.")
        gone = gauge(
            "specroute_backend_gone",
            "1 while a backend found by name is drained because the name no longer resolves to it.",
        )
        learned = gauge(
            "specroute_learned_crossover",
            "Concurrency from which this speculative backend is predicted slower than the standard pool.",
            ("content",),
        )
        client_slots = GaugeMetricFamily(
            "specroute_client_slots",
            "Slots of a pool a client holds: the fairness.top_clients clients holding most, by a hash "
            'of their identity, and the rest summed as client="others".',
            labels=["pool", "client"],
        )
        entered = CounterMetricFamily(
            "specroute_queue_entries",
            "Requests that found no slot of a pool they could take on arrival and joined its queue (then served, "
            "timed out, or turned away by a full queue).",
            labels=["pool", "job_class"],
        )
        held_back = CounterMetricFamily(
            "specroute_held_back_requests",
            "Requests that waited in a pool's queue although a slot was free: their client held its share while "
            "others were active (fairness.keep_room).",
            labels=["pool"],
        )
        newcomers = CounterMetricFamily(
            "specroute_newcomer_requests",
            "Requests admitted over a backend's max_concurrency: their client held no slot in the pool, every slot "
            "was taken, and the engine showed KV room (fairness.newcomer_slots).",
            labels=["pool"],
        )
        now = self._clock.now()
        config = self.config
        standard = [b.name for pool in self._pools if not pool.speculative for b in pool.backends]
        for pool in self._pools:
            for backend in pool.backends:
                key = [pool.name, backend.name]
                in_flight.add_metric(key, backend.in_flight)
                healthy.add_metric(key, float(backend.healthy))
                draining.add_metric(key, float(backend.draining))
                if backend.found_by is not None:
                    gone.add_metric(key, float(backend.gone))
                oldest_waiting.add_metric(key, backend.first_tokens.oldest_wait(now))
                measured = backend.engine.acceptance
                if measured is not None:
                    acceptance_age.add_metric(key, now - measured.measured_at)
                    if now - measured.measured_at <= config.acceptance_max_age:
                        acceptance.add_metric(key, measured.ratio)
                        if measured.length is not None:
                            accept_length.add_metric(key, measured.length)
                if pool.speculative:
                    for kind in CONTENT_KINDS:
                        level = crossover(self._speeds, backend.name, standard, kind)
                        if level is not None:
                            learned.add_metric([*key, kind], level)
                engine = backend.engine.reading
                fresh = engine.fresh(now, config.stale_after)
                stale.add_metric(key, float(not fresh))
                if not fresh:
                    continue
                for family, value in (
                    (running, engine.running),
                    (waiting, engine.waiting),
                    (kv, engine.kv_usage),
                ):
                    if value is not None:
                        family.add_metric(key, value)
            for job in JOB_CLASSES:
                queued.add_metric([pool.name, job], pool.queued(job))
                entered.add_metric([pool.name, job], pool.entered[job])
            held_back.add_metric([pool.name], pool.held_back)
            newcomers.add_metric([pool.name], pool.newcomers.admitted)
            named, others = pool.shares(self.top_clients)
            for client, slots in named:
                client_slots.add_metric([pool.name, client_hash(client)], slots)
            if others:
                client_slots.add_metric([pool.name, "others"], others)
        yield from (in_flight, healthy, draining, gone, queued, entered, held_back, newcomers, running, waiting)
        yield from (kv, acceptance, accept_length, acceptance_age, stale, learned, oldest_waiting, client_slots)
