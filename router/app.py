"""`create_app(settings)`: the routes, the error handlers and the lifespan of one router."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from router.auth import Auth
from router.config import Settings
from router.errors import MethodNotAllowed, NotFound, RouterError
from router.headers import bearer
from router.health import HealthChecker
from router.learn import SpeedModel
from router.metrics import Metrics
from router.models import ModelCatalog
from router.pools import Clients, Pools
from router.proxy import Proxy
from router.scrape import EngineScraper
from router.status import status
from router.upstream import UpstreamPool


def create_app(settings: Settings, *, registry: CollectorRegistry | None = None) -> Starlette:
    pools = Pools(settings)
    speeds = SpeedModel()
    registry = registry if registry is not None else CollectorRegistry()
    metrics = Metrics(registry, pools, speeds, stale_after=settings.scrape.stale_after)
    # One connection pool for every backend; it keeps as many idle connections per backend as
    # the router may send it requests at once.
    upstream = UpstreamPool(
        connect_timeout=settings.timeouts.connect,
        read_timeout=settings.timeouts.read,
        idle_timeout=settings.timeouts.idle,
        max_idle_per_origin=max(backend.max_concurrency for backend in pools.backends()),
    )
    clients = Clients(
        memory=settings.classify.client_memory_seconds,
        burst_hold=settings.classify.burst_hold_seconds,
        threshold=settings.classify.batch_inflight_threshold,
    )
    auth = Auth(settings.auth)
    proxy = Proxy(settings, pools=pools, clients=clients, speeds=speeds, metrics=metrics, upstream=upstream, auth=auth)
    catalog = ModelCatalog(pools, upstream, ttl=settings.models_cache_seconds, timeout=settings.health.timeout)
    health = HealthChecker(pools, upstream, settings.health)
    scraper = EngineScraper(pools, upstream, interval=settings.scrape.interval, timeout=settings.scrape.timeout)

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        backends = {b.name: b.healthy for b in pools.backends()}
        ready = any(backends.values())
        return JSONResponse({"ready": ready, "backends": backends}, status_code=200 if ready else 503)

    async def prometheus(request: Request) -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    async def models(request: Request) -> Response:
        auth.check_client(bearer(request.headers.get("authorization")))
        return JSONResponse({"object": "list", "data": await catalog.models()})

    async def router_status(request: Request) -> Response:
        return JSONResponse(status(settings, pools, speeds))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await health.check_all(first=True)
        tasks = [asyncio.create_task(health.run()), asyncio.create_task(scraper.run())]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await upstream.aclose()

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 405:
            return MethodNotAllowed(f"{request.method} is not allowed on {request.url.path}").response(
                dict(exc.headers or {})
            )
        if exc.status_code == 404:
            return NotFound(f"no route for {request.method} {request.url.path}").response()
        error = RouterError(str(exc.detail))
        error.status_code = exc.status_code
        return error.response()

    async def router_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RouterError)
        return exc.response()

    app = Starlette(
        routes=[
            Route("/healthz", healthz),
            Route("/readyz", readyz),
            Route("/metrics", prometheus),
            Route("/v1/models", models),
            Route("/router/status", router_status),
            Route("/v1/{path:path}", proxy, methods=["POST"]),
        ],
        exception_handlers={HTTPException: http_error, RouterError: router_error},
        lifespan=lifespan,
    )
    app.state.pools = pools
    app.state.metrics = metrics
    app.state.upstream = upstream
    return app
