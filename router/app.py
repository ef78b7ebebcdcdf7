"""`create_app(settings)`: the routes, the error handlers and the lifespan of one router."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from router.admin import admin_routes
from router.batch.api import batch_routes
from router.batch.service import BatchService
from router.clock import Clock
from router.config import Settings
from router.errors import LoopDetected, MethodNotAllowed, NotFound, RouterError
from router.replicas.store import Store
from router.replies import error_response
from router.request.headers import bearer
from router.runtime import Router
from router.status import status

if TYPE_CHECKING:
    from router.workers.peers import Peers


def create_app(
    settings: Settings,
    *,
    registry: CollectorRegistry | None = None,
    load: Callable[[], Settings] | None = None,
    clock: Callable[[], float] = time.time,
    live_clock: Clock | None = None,
    workers: Peers | None = None,
    store: Store | None = None,
) -> Starlette:
    """`load` reads the settings again for a reload (SIGHUP, /admin/reload); None: no reloads.
    `clock` is the wall clock of the Batch API's timestamps and expiry (tests move it);
    `live_clock` the monotonic one of the live state (router.clock). `workers`: the other worker
    processes (router.workers), for whom /metrics, /router/status and the admin API speak too;
    `store`: what the state is shared through when it is not the configured Redis."""
    router = Router(
        settings,
        registry=registry,
        load=load,
        clock=live_clock,
        batches=lambda r: BatchService(r, clock=clock),
        identity=workers.identity if workers is not None else None,
    )
    batches = router.batches
    assert isinstance(batches, BatchService)

    async def healthz(request: Request) -> Response:
        # Also served at /health, the path vLLM and SGLang use, which load tools probe first.
        if router.via in request.headers.get("via", ""):
            # This router's own probe: a name resolved to it, or a backend's URL is its own.
            raise LoopDetected("this router's health check reached this router", code="loop_detected")
        return JSONResponse({"status": "ok"})

    async def version(request: Request) -> Response:
        return JSONResponse(router.build.as_dict())

    async def readyz(request: Request) -> Response:
        backends = {b.name: b.accepting for b in router.pools.backends()}
        ready = any(backends.values()) and not router.shutting_down
        body = {
            "ready": ready,
            "backends": backends,
            "shutting_down": router.shutting_down,
            "shared_state": router.replicas.status(),  # details only: a replica alone still serves
        }
        return JSONResponse(body, status_code=200 if ready else 503)

    async def prometheus(request: Request) -> Response:
        body = router.metrics.exposition()
        if workers is not None and workers.public(request):
            from router.workers.exposition import merge

            others = await workers.ask("GET", "/metrics")
            body = merge([body, *(answer.body for answer in others if answer.status == 200)])
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def models(request: Request) -> Response:
        router.plan.auth.check_client(bearer(request.headers.get("authorization")))
        return JSONResponse({"object": "list", "data": await router.catalog.models()})

    async def model(request: Request) -> Response:
        router.plan.auth.check_client(bearer(request.headers.get("authorization")))
        model_id = request.path_params["model"]
        found = await router.catalog.model(model_id)
        if found is None:  # as OpenAI words it
            message = f"The model `{model_id}` does not exist or you do not have access to it."
            raise NotFound(message, code="model_not_found")
        return JSONResponse(found)

    async def router_status(request: Request) -> Response:
        view = status(router.plan, router.pools, router.speeds, now=router.clock.now())
        if workers is not None and workers.public(request):
            view = await workers.status(view, store)
        return JSONResponse({**view, "batches": batches.status()})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        router.replicas.open(store)
        await router.discovery.refresh()  # backends found by name, each probed once found
        await asyncio.gather(router.health.check_all(first=True), router.catalog.learn_names())
        tasks = [
            asyncio.create_task(router.replicas.run()),
            asyncio.create_task(router.discovery.run()),
            asyncio.create_task(router.health.run()),
            asyncio.create_task(router.scraper.run()),
            asyncio.create_task(router.catalog.run()),  # the model names the metrics may use
            asyncio.create_task(router.traffic.run()),  # the traffic record, when one is kept
        ]
        await batches.start()
        try:
            yield
        finally:
            await batches.stop()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # ended before their client closes
            await router.transport.aclose()
            await router.replicas.aclose()
            if workers is not None:
                await workers.aclose()
            if router.tracer is not None:
                await router.tracer.aclose()

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 405:
            return error_response(
                MethodNotAllowed(f"{request.method} is not allowed on {request.url.path}"), dict(exc.headers or {})
            )
        if exc.status_code == 404:
            return error_response(NotFound(f"no route for {request.method} {request.url.path}"))
        error = RouterError(str(exc.detail))
        error.status_code = exc.status_code
        return error_response(error)

    async def router_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RouterError)
        return error_response(exc)

    # Before the catch-all: /v1/models[/{id}], and /v1/files and /v1/batches with the Batch API, are the router's own.
    own = [
        Route("/v1/models", models),
        Route("/v1/models/{model:path}", model),
        *(batch_routes(batches) if batches.enabled else []),
    ]
    app = _RouterApp(
        proxy=router.pipeline,
        own=own,
        routes=[
            Route("/healthz", healthz),
            Route("/health", healthz),
            Route("/version", version),
            Route("/readyz", readyz),
            Route("/metrics", prometheus),
            Route("/router/status", router_status),
            *admin_routes(router, workers),
            *own,
            # GET and DELETE too: stored responses (and files, batches without the Batch API).
            Route("/v1/{path:path}", _ProxyElsewhere(own, router.pipeline), methods=["GET", "POST", "DELETE"]),
        ],
        exception_handlers={HTTPException: http_error, RouterError: router_error},
        lifespan=lifespan,
    )
    app.state.router = router
    app.state.batches = batches
    return app


# The methods the catch-all route forwards (Starlette adds HEAD to a GET route: HEAD goes its way).
_FORWARDED = frozenset({"GET", "POST", "DELETE"})


class _RouterApp(Starlette):
    """Starlette, except that a request the proxy forwards goes to it directly.

    Starlette's middleware (its 500 guard, the exception handlers) and its routing cost a share
    of the router's time per request and do nothing for a forwarded request: the
    pipeline reads the request id, checks the limits, answers its errors in OpenAI's shape,
    guards against its own bugs and writes the access log itself. Everything else (the router's
    own endpoints, /v1/models, the Batch API's /v1/files and /v1/batches, other methods, a mounted
    root path) goes through Starlette as before."""

    def __init__(self, *, proxy: ASGIApp, own: list[BaseRoute], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._proxy = proxy
        self._own = [route.path_regex for route in own if isinstance(route, Route | Mount)]  # what Starlette matches

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] in _FORWARDED
            and scope["path"].startswith("/v1/")
            and not scope.get("root_path")
            and not any(own.match(scope["path"]) for own in self._own)
        ):
            scope["app"] = self
            await self._proxy(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


class _ProxyElsewhere:
    """The proxy, except on a path the router serves itself: another method there is its 405,
    never forwarded (a route that matches only the path loses to the catch-all that matches both).
    A class, not a function: Starlette hands a function route a Request, an ASGI app its scope."""

    def __init__(self, own: list[BaseRoute], proxy: ASGIApp) -> None:
        self._proxy = proxy
        self._allowed: dict[str, set[str]] = {}
        for route in own:
            if isinstance(route, Route) and route.methods is not None:
                self._allowed.setdefault(route.path, set()).update(route.methods)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        methods = self._allowed.get(scope["path"])
        if methods is not None:
            raise HTTPException(405, headers={"Allow": ", ".join(sorted(methods))})
        await self._proxy(scope, receive, send)
