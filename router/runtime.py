"""`Router`: one router's parts, built from its settings, and what an operator does to it while
it runs — reload the settings, drain and resume backends, shut down gracefully.

`Router.__init__` builds the parts without settings and calls `apply(settings)`: the one place
where settings reach the parts, at start and on every reload. Each part takes its own section;
the request path takes one frozen `Plan` (router.plan), swapped whole.

A reload changes the parts in place rather than building new ones: requests under way keep
their pool and backend, a backend still configured with the same URL keeps its requests in
flight, health, engine readings and learned speeds, and nothing listening is restarted.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import ssl
from collections.abc import Callable
from typing import Any, Protocol

from prometheus_client import CollectorRegistry
from yarl import URL

from router.backends.backend import Backend
from router.backends.discovery import Discovery, Resolver, SystemResolver
from router.backends.health import HealthChecker
from router.backends.outlier import state_log
from router.backends.pools import Pools
from router.backends.scrape import EngineScraper
from router.catalog import ModelCatalog
from router.clock import Clock, MonotonicClock
from router.config import Batch, ConfigError, Settings, Tracing, masked, nameserver
from router.errors import BadRequest, Conflict, NotFound
from router.metrics import Metrics
from router.replicas.shared import Replicas
from router.request.forward import Forwarder
from router.request.observe import Observer
from router.request.pipeline import Pipeline
from router.request.plan import Plan, compile_plan
from router.responses.affinity import ResponseAffinity
from router.responses.locate import Locator
from router.responses.stage import StoredResponses
from router.routing.clients import Clients
from router.routing.conversations import ConversationIndex
from router.routing.learn import SpeedModel
from router.routing.limits import Limiter
from router.tracing import Tracer
from router.traffic import TrafficRecorder
from router.transport import EngineClient, tls_context
from router.version import BuildInfo, build_info

logger = logging.getLogger("specroute")

# Settings that a running router cannot take: its socket is already bound, its log set up, its
# batch store open, and each connection is held to the client limits it was accepted with (router/listener.py).
NEEDS_RESTART = (
    "listen.",
    "log.",
    "timeouts.request_head",
    "timeouts.keep_alive",
    "timeouts.client_write",
    "limits.request_head_bytes",
    "limits.request_headers",
    "limits.max_connections",
    "batch.store_dir",
    "batch.store",
    "batch.postgres_dsn_env",
    "batch.enabled",
    "state.",
    "tracing.",
)


class BatchParts(Protocol):
    """The Batch API's parts (router.batch.service.BatchService): built with the router, which
    they serve through, and given their section by `apply` like every other part."""

    def configure(self, config: Batch) -> None: ...


class Router:
    def __init__(
        self,
        settings: Settings,
        *,
        registry: CollectorRegistry | None = None,
        load: Callable[[], Settings] | None = None,
        build: BuildInfo | None = None,
        clock: Clock | None = None,
        batches: Callable[[Router], BatchParts] | None = None,
        identity: str | None = None,
    ) -> None:
        """`batches` builds the Batch API's parts on this router (router.app); None: no Batch API.
        `identity`: what this router (all of its worker processes) is called in a `Via` header;
        None: a random one."""
        # In the `Via` of its health probes: its own /health refuses them (router.app).
        self.via = f"1.1 specroute-{identity or secrets.token_hex(8)}"
        self.build = build if build is not None else build_info()
        self._load = load  # where a reload reads the settings from; None: nowhere
        self.shutting_down = False
        self.clock: Clock = clock if clock is not None else MonotonicClock()
        # The parts, built without settings: `apply` below is the one place settings reach them.
        self.pools = Pools(clock=self.clock)
        self.speeds = SpeedModel(clock=self.clock)
        self.metrics = Metrics(
            registry if registry is not None else CollectorRegistry(),
            self.pools,
            self.speeds,
            build=self.build,
            known_models=self.known_models,
            clock=self.clock,
        )
        # One client for everything sent to the engines: requests, scrapes, probes, model lists.
        # Its TLS context trusts nothing until `apply` gives it the configured one.
        self.transport = EngineClient(connections_per_origin=1, tls=ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT))
        self.clients = Clients(clock=self.clock)
        self.limiter = Limiter()  # its counters outlive a reload
        # What the replicas share (router.replicas): nothing until `apply` names a store.
        self.replicas = Replicas(pools=self.pools, clients=self.clients, metrics=self.metrics, clock=self.clock)
        self.traffic = TrafficRecorder(clock=self.clock)
        self.observer = observer = Observer(self.metrics, self.speeds, self.traffic)
        self.owners = ResponseAffinity()  # which backend made each stored response (Responses API)
        self.locator = Locator(self.transport)  # and which holds one this router never saw made
        self.conversations = ConversationIndex()  # which backends hold which prompts' prefixes
        # Tracing is set up once, at start: the exporter's thread and queue live as long as the router.
        self.tracer = _tracer(settings.tracing, self.build.version)
        self.pipeline = Pipeline(
            pools=self.pools,
            clients=self.clients,
            replicas=self.replicas,
            speeds=self.speeds,
            forwarder=Forwarder(self.pools, self.transport, observer, self.clock, self.replicas),
            observer=observer,
            owners=StoredResponses(
                pools=self.pools, owners=self.owners, locator=self.locator, observer=observer, clock=self.clock
            ),
            conversations=self.conversations,
            limiter=self.limiter,
            clock=self.clock,
            tracer=self.tracer,
        )
        self.catalog = ModelCatalog(self.pools, self.transport, clock=self.clock)
        self.health = HealthChecker(self.pools, self.transport, clock=self.clock, via=self.via)
        self.scraper = EngineScraper(self.pools, self.transport, clock=self.clock)
        self.discovery = Discovery(self.pools, self.health, self.speeds, self.metrics, forget=self._forget)
        self.batches = batches(self) if batches is not None else None
        self._settings: Settings | None = None
        self.apply(settings)

    @property
    def settings(self) -> Settings:
        """The settings last applied, for what reads them only at start: the server's listening
        and connection limits (router.listener), which need a restart."""
        assert self._settings is not None
        return self._settings

    @property
    def plan(self) -> Plan:
        """What the request path reads of the settings now (router.request.plan)."""
        plan = self.pipeline.plan
        assert plan is not None
        return plan

    def known_models(self) -> frozenset[str]:
        """Model names that the metrics count under their own name (see router.metrics)."""
        return self.catalog.known | self._configured_models

    def reload(self) -> dict[str, list[str]]:
        """Read the settings again and apply them; an invalid file changes nothing (BadRequest)."""
        if self._load is None:
            raise Conflict("this router was not started from a configuration file", code="nothing_to_reload")
        try:
            settings = self._load()
            changed = self.apply(settings)
        except (ConfigError, ssl.SSLError) as exc:
            self.metrics.reloads.labels("invalid").inc()
            raise BadRequest(
                f"configuration not reloaded, the running one is kept: {exc}", code="invalid_config"
            ) from exc
        self.metrics.reloads.labels("applied").inc()
        return changed

    def reload_logged(self) -> None:
        """A reload asked for by a signal: the outcome goes to the log."""
        try:
            result = self.reload()
        except (BadRequest, Conflict) as exc:
            logger.error("reload: %s", exc.message)
        else:
            logger.info("reload: applied; changed: %s", ", ".join(result["changed"]) or "nothing")
            if result["needs_restart"]:
                logger.warning("reload: takes effect only after a restart: %s", ", ".join(result["needs_restart"]))

    def apply(self, settings: Settings) -> dict[str, list[str]]:
        """The one mapping of settings onto the parts, at start and on every reload; each part
        takes its own section. Returns the settings that changed, and those of them that only a
        restart can apply."""
        previous = self._settings
        # First, what can fail (a certificate file that is PEM in name only): then nothing has changed.
        # A new TLS context starts new connections (pooled apart), so it is made only when `tls` changed.
        tls = tls_context(settings.tls) if previous is None or settings.tls != previous.tls else self.transport.tls
        plan = compile_plan(settings)
        changed = _differences(masked(previous), masked(settings)) if previous is not None else []
        drained = [backend for backend in self.pools.backends() if backend.draining]
        resolver = _resolver(settings)
        for name in self.pools.configure(settings.pools, settings.health, settings.fairness):
            self._forget(name)
        for pool in self.pools:
            pool.newcomers.configure(settings.fairness, settings.routing, settings.scrape)
        self.discovery.configure(settings.pools, settings.discovery, settings.health, resolver)
        # A drained backend configured anew (another URL or pool) is a new backend, not drained.
        now = {backend.name: backend for backend in self.pools.backends()}
        for old in drained:
            new = now.get(old.name)
            if new is not None and new is not old and not new.draining:
                _log_drain(new, "a reload configured it anew (another URL or pool), the drain is not kept")
        self.clients.configure(settings.classify)
        self.limiter.configure(settings.fairness)
        self.replicas.configure(
            settings.state, stale_after=settings.scrape.stale_after, memory=settings.classify.client_memory_seconds
        )
        # Timeouts and limits go with each request (the plan), so they reach pooled connections too.
        self.transport.configure(connections_per_origin=_connections_per_origin(settings, self.pools), tls=tls)
        self.metrics.configure(settings.scrape, top_clients=settings.fairness.top_clients)
        self.catalog.configure(ttl=settings.models_cache_seconds, timeout=settings.health.timeout)
        self.health.configure(settings.health)
        self.scraper.configure(settings.scrape)
        self.speeds.configure(
            settings.learn,
            priors={backend.name: settings.pools[backend.pool].prior_speed for backend in self.pools.backends()},
        )
        self.owners.configure(settings.responses)
        self.conversations.configure(settings.conversations)
        self.traffic.configure(settings.traffic)
        self.locator.configure(settings.responses)
        self._configured_models = frozenset(
            {rule.rewrite_model for rule in settings.classify.rules if rule.rewrite_model}
            | set(settings.metrics.models)
        )
        self.grace_seconds = settings.shutdown.grace_seconds
        if self.batches is not None:
            self.batches.configure(settings.batch)
        self.pipeline.plan = plan  # last, whole: a request takes the old plan or the new one
        self._settings = settings
        return {"changed": changed, "needs_restart": [key for key in changed if key.startswith(NEEDS_RESTART)]}

    def _forget(self, backend: str) -> None:
        """What is kept of a backend beside it, once it is gone: its learned speeds, its series, and
        what its health checks logged once."""
        self.speeds.forget(backend)
        self.observer.forget(backend)
        self.health.forget(backend)

    def set_draining(
        self,
        *,
        pool: str | None = None,
        backend: str | None = None,
        draining: bool,
        reason: str = "asked by an operator",
    ) -> list[Backend]:
        """Drain (or resume) one backend, or every backend of a pool: a drained backend takes no
        new work, and its running requests finish. Each backend whose state this changes is
        logged once with `reason` (who asked); one already in that state is not."""
        if pool is not None:
            found = self.pools.get(pool)
            if found is None:
                raise NotFound(f"no pool named {pool!r}", param="pool", code="unknown_pool")
            backends = found.backends
        else:
            backends = [b for b in self.pools.backends() if b.name == backend]
            if not backends:
                raise NotFound(f"no backend named {backend!r}", param="backend", code="unknown_backend")
        for target in backends:
            if target.draining != draining:
                target.draining = draining
                _log_drain(target, reason)
        for each in self.pools:
            each.wake()  # resumed: queued work may go there; drained: a queue with nowhere to go fails
        return backends

    def begin_shutdown(self) -> None:
        """The start of a graceful shutdown: running requests have the grace period to finish."""
        self.shutting_down = True
        grace = self.grace_seconds
        logger.info("shutting down: running requests have %g s to finish", grace)
        asyncio.get_running_loop().call_later(grace, self.pipeline.end_all)


def _log_drain(backend: Backend, reason: str) -> None:
    state = "drained" if backend.draining else "resumed"
    state_log.info("backend %s (pool %s) %s: %s", backend.name, backend.pool, state, reason)


def _connections_per_origin(settings: Settings, pools: Pools) -> int:
    """As many connections to an engine as requests may be admitted to it, newcomers over its cap
    included (backends sharing an origin add up; one found by name has an origin of its own)."""
    over = settings.fairness.newcomer_slots if settings.fairness.fair_share else 0
    per_origin: dict[str, int] = {}
    for backend in pools.backends():
        origin = str(URL(backend.url).origin())
        per_origin[origin] = per_origin.get(origin, 0) + backend.max_concurrency + over
    found = [
        b.max_concurrency + over for p in settings.pools.values() for b in p.backends.values() if b.discover != "none"
    ]
    return max([*per_origin.values(), *found], default=1)


def _tracer(config: Tracing, version: str) -> Tracer | None:
    """The OpenTelemetry tracer when tracing is on; its packages are loaded only then."""
    if not config.enabled:
        return None
    from router.otel import OtelTracer

    return OtelTracer(config, version=version)


def _resolver(settings: Settings) -> Resolver:
    """The system's resolver, or dnspython's where SRV records or chosen nameservers need it."""
    config = settings.discovery
    srv = any(b.discover == "srv" for pool in settings.pools.values() for b in pool.backends.values())
    if not srv and not config.nameservers:
        return SystemResolver()
    from router.backends.nameservers import DnsResolver  # the settings checked it is installed

    servers = [nameserver(server) for server in config.nameservers]
    return DnsResolver(servers, timeout=config.timeout, limit=config.max_addresses)


def _differences(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted names of the settings that differ between two plain-data trees."""
    if isinstance(old, dict) and isinstance(new, dict):
        changed = []
        for key in sorted(set(old) | set(new), key=str):
            changed += _differences(old.get(key), new.get(key), f"{prefix}{key}.")
        return changed
    return [prefix.removesuffix(".")] if old != new else []
