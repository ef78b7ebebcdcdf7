"""The simulated engine behind an OpenAI-compatible HTTP API, in vLLM's wire format.

The routes: chat completions and completions (answers built by `reply`, requests read by
`protocol`), embeddings (`embed`), the model list, `/health`, `/version`, and `/metrics` with
vLLM's metric names. Any other path answers an OpenAI-shaped error saying the simulator does not
support it. Every response carries `X-Request-Id`, as vLLM's does with
`--enable-request-id-headers`, and the request's own id is the base of its answer's id.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.datastructures import Headers, MutableHeaders
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.sim import embed, protocol
from router.sim.engine import Counters
from router.sim.profile import Profile
from router.sim.protocol import EngineError
from router.sim.reply import Reply
from router.sim.runner import EngineRunner, Generation

VERSION = "0.11.0+specroute-sim"
PREFILL_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip


def create_sim_app(
    profile: Profile,
    *,
    time_scale: float = 1.0,
    seed: int = 0,
    embedding_size: int | None = None,
    prompt_tokens_details: bool = False,
) -> Starlette:
    """`prompt_tokens_details`: usage says the prompt tokens found cached, as vLLM's
    `--enable-prompt-tokens-details`."""
    runner = EngineRunner(profile, time_scale=time_scale, seed=seed)
    registry = CollectorRegistry()
    stats = _EngineStats(runner, profile.model)
    registry.register(stats)
    dimensions = embedding_size or profile.embedding_size

    async def completions(request: Request) -> Response:
        try:
            params = protocol.parse(await request.body(), profile, chat=request.url.path.endswith("/chat/completions"))
        except EngineError as exc:
            return exc.response()
        reply = Reply.submit(
            runner,
            params,
            model=profile.model,
            request_id=_base_request_id(request, params.request_id),
            seed=seed,
            on_first_token=stats.first_token,
            cached_tokens=prompt_tokens_details,
        )
        if params.stream:
            return StreamingResponse(_guarded(reply.stream(), runner, reply), media_type="text/event-stream")
        return await _whole(request, reply, runner)

    async def embeddings(request: Request) -> Response:
        try:
            body = protocol.load(await request.body(), profile)
            inputs, size, encoding = embed.parse(body, dimensions, max_model_len=profile.max_model_len)
        except EngineError as exc:
            return exc.response()
        request_id = "embd-" + _base_request_id(request, body.get("request_id"))
        return JSONResponse(embed.response(inputs, size, encoding, model=profile.model, request_id=request_id))

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def models(request: Request) -> Response:
        card = {
            "id": profile.model,
            "object": "model",
            "created": 0,
            "owned_by": "vllm",
            "root": profile.model,
            "parent": None,
            "max_model_len": profile.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def version(request: Request) -> Response:
        return JSONResponse({"version": VERSION})

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def unsupported(request: Request) -> Response:
        modelled = "chat completions, completions, embeddings, models, health, version and metrics"
        what = f"{request.method} {request.url.path} (it models {modelled})"
        return EngineError(protocol.not_supported(what).message, status=404, kind="NotFoundError").response()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        task = asyncio.create_task(runner.run())
        try:
            yield
        finally:
            task.cancel()

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/embeddings", embeddings, methods=["POST"]),
            Route("/v1/models", models),
            Route("/health", health),
            Route("/version", version),
            Route("/metrics", metrics),
            Route("/{path:path}", unsupported, methods=["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]),
        ],
        middleware=[Middleware(_RequestIdHeader)],
        lifespan=lifespan,
    )
    app.state.runner = runner
    return app


def _base_request_id(request: Request, body_id: Any) -> str:
    """vLLM's `_base_request_id`: the `X-Request-Id` header, else the body's `request_id`, else new."""
    header = request.headers.get("x-request-id")
    if header is not None:
        return header
    return body_id if isinstance(body_id, str) else uuid.uuid4().hex


class _RequestIdHeader:
    """vLLM's `--enable-request-id-headers`: every response carries `X-Request-Id`, the request's
    own or a new one (not the answer's id then: vLLM makes the two apart)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = Headers(scope=scope).get("x-request-id") or uuid.uuid4().hex

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(raw=message["headers"]).append("X-Request-Id", request_id)
            await send(message)

        await self.app(scope, receive, send_with_id)


async def _guarded(chunks: AsyncIterator[bytes], runner: EngineRunner, reply: Reply) -> AsyncIterator[bytes]:
    """Pass chunks on; if the client leaves (the response is cancelled), abort and free the KV."""
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        for generation in reply.generations:
            runner.abort(generation)


async def _whole(request: Request, reply: Reply, runner: EngineRunner) -> Response:
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    answer = asyncio.ensure_future(reply.whole())
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({answer, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not answer.done():
            answer.cancel()
            for generation in reply.generations:
                runner.abort(generation)
    if not answer.done() or answer.cancelled():
        return Response(status_code=499)
    return JSONResponse(answer.result())


class _EngineStats(Collector):
    """vLLM's metrics, read from the engine model at scrape time, plus a TTFT histogram."""

    def __init__(self, runner: EngineRunner, model: str) -> None:
        self._runner = runner
        self._model = model
        self._ttft = _Observed(TTFT_BUCKETS)
        self._prefill = _Observed(PREFILL_BUCKETS)

    def first_token(self, generation: Generation) -> None:
        """Durations in wall-clock seconds, as clients and the router measure them: at `time_scale`
        N this is an engine N times faster, not one whose clock runs N times slower."""
        request = generation.request
        if request.first_token_at is None:
            return
        scale = self._runner.time_scale
        self._ttft.observe((request.first_token_at - request.arrival) / scale)
        # vLLM's prefill time runs from the step that first schedules some of its prompt: a
        # request admitted here while others' prompts take the step's token budget is, in vLLM,
        # still waiting.
        started = request.prefill_started_at
        if started is not None:
            self._prefill.observe((request.first_token_at - started) / scale)

    def collect(self) -> Iterator[Metric]:
        engine = self._runner.engine
        counters = engine.counters
        labels = ["model_name"]
        model = [self._model]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(model, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(model, value)
            return family

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", len(engine.running))
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", len(engine.waiting))
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", engine.kv_usage)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", counters.prompt_tokens)
        yield from self._prefix_cache(counters)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", counters.generation_tokens)
        yield counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", counters.spec_drafts)
        yield counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", counters.spec_draft_tokens)
        yield counter(
            "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", counters.spec_accepted_tokens
        )
        yield counter("vllm:request_success", "Count of successfully processed requests.", counters.finished)
        yield self._cache_config()
        yield self._ttft.family(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", self._model
        )
        yield self._prefill.family(
            "vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", self._model
        )
        yield GaugeMetricFamily(
            "specroute_sim_lag_seconds", "How far the simulation runs behind its time scale.", value=self._runner.lag
        )

    def _prefix_cache(self, counters: Counters) -> Iterator[Metric]:
        """vLLM's prefix-cache counters: tokens looked up and found for new requests, and the
        prompt tokens by where they came from (this engine has no external KV source)."""
        model = [self._model]
        for name, doc, value in (
            ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
             counters.prefix_queries),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             counters.prefix_hits),
            ("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).",
             counters.prefix_hits),
        ):  # fmt: skip
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(model, value)
            yield family
        by_source = CounterMetricFamily(
            "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", labels=["model_name", "source"]
        )
        by_source.add_metric([*model, "local_compute"], counters.prompt_tokens - counters.prefix_hits)
        by_source.add_metric([*model, "local_cache_hit"], counters.prefix_hits)
        by_source.add_metric([*model, "external_kv_transfer"], 0)
        yield by_source

    def _cache_config(self) -> Metric:
        """vLLM's `cache_config_info`: the KV cache's size, and how many requests of
        `max_model_len` it holds. The simulated engine reserves a request's prompt, its answer and
        the profile's overhead, so it holds fewer than its size over that length; with the length
        stated too, the router reads the overhead from the difference (router.engines)."""
        profile = self._runner.engine.profile
        block = profile.block_size
        holds = profile.kv_cache_tokens / (profile.kv_overhead_tokens + profile.max_model_len)
        labels = {
            "block_size": str(block),
            "num_gpu_blocks": str(profile.kv_cache_tokens // block),
            "kv_cache_size_tokens": str(profile.kv_cache_tokens),
            "max_model_len": str(profile.max_model_len),
            "kv_cache_max_concurrency": f"{holds:.4f}",
            "enable_prefix_caching": str(profile.prefix_caching),
        }
        family = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(labels)
        )
        family.add_metric(list(labels.values()), 1.0)
        return family


class _Observed:
    """A histogram's buckets, sum and count, exported as vLLM's (per `model_name`)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self._counts = [0] * len(bounds)
        self._sum = 0.0
        self._n = 0

    def observe(self, value: float) -> None:
        self._sum += value
        self._n += 1
        for i, bound in enumerate(self._bounds):
            if value <= bound:
                self._counts[i] += 1

    def family(self, name: str, doc: str, model: str) -> Metric:
        family = HistogramMetricFamily(name, doc, labels=["model_name"])
        buckets = [(str(bound), float(count)) for bound, count in zip(self._bounds, self._counts, strict=True)]
        buckets.append(("+Inf", float(self._n)))
        family.add_metric([model], buckets, self._sum)
        return family
