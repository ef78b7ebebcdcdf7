"""The simulated engine behind an OpenAI-compatible HTTP API, in vLLM's wire format.

Streams: a role-only first chunk, content chunks (one per engine step, carrying every token the
step produced), a finish chunk, the usage chunk when `stream_options.include_usage` is set, and
`data: [DONE]`. Errors use vLLM's envelope. `/metrics` carries vLLM's metric names.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from router.content import ContentKind, detect_kind, request_text
from router.prompts import chat_prompt_tokens, count_tokens
from router.sim.profile import Profile
from router.sim.runner import EngineRunner, Generation
from router.sim.text import tokens as text_tokens

VERSION = "0.11.0+specroute-sim"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip


class EngineError(Exception):
    def __init__(self, message: str, *, status: int = 400, kind: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.kind, self.param = message, status, kind, param

    def response(self) -> Response:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}
        return JSONResponse(body, status_code=self.status)


def create_sim_app(profile: Profile, *, time_scale: float = 1.0, seed: int = 0) -> Starlette:
    runner = EngineRunner(profile, time_scale=time_scale, seed=seed)
    registry = CollectorRegistry()
    stats = _EngineStats(runner, profile.model)
    registry.register(stats)

    async def completions(request: Request) -> Response:
        chat = request.url.path.endswith("/chat/completions")
        try:
            params = _parse(await request.body(), profile, chat=chat)
        except EngineError as exc:
            return exc.response()
        generation = runner.submit(
            prompt_tokens=params.prompt_tokens,
            max_tokens=params.max_tokens,
            kind=params.kind,
            ignore_eos=params.ignore_eos,
            min_tokens=params.min_tokens,
        )
        reply = _Reply(profile.model, chat, params, generation, seed)
        if params.stream:
            return StreamingResponse(
                _guarded(reply.stream(), runner, stats, generation), media_type="text/event-stream"
            )
        return await _whole(request, reply, runner, stats, generation)

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
            Route("/v1/models", models),
            Route("/health", health),
            Route("/version", version),
            Route("/metrics", metrics),
        ],
        lifespan=lifespan,
    )
    app.state.runner = runner
    return app


@dataclass(frozen=True, slots=True)
class _Params:
    prompt_tokens: int
    max_tokens: int | None
    min_tokens: int
    ignore_eos: bool
    stream: bool
    include_usage: bool
    kind: ContentKind


def _parse(raw: bytes, profile: Profile, *, chat: bool) -> _Params:
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise EngineError(f"Invalid JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise EngineError("The request body must be a JSON object.")
    if body.get("model") != profile.model:
        raise EngineError(
            f"The model `{body.get('model')}` does not exist.", status=404, kind="NotFoundError", param="model"
        )
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise EngineError("`messages` must be a non-empty list.", param="messages")
        prompt_tokens = chat_prompt_tokens([request_text({"messages": [m]}) for m in messages])
    else:
        if not isinstance(body.get("prompt"), str | list):
            raise EngineError("`prompt` must be a string or a list of strings.", param="prompt")
        prompt_tokens = count_tokens(request_text(body)) + 1
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise EngineError("max_tokens must be at least 1.", param="max_tokens")
    if max_tokens is not None and prompt_tokens + max_tokens > profile.max_model_len:
        raise EngineError(
            f"This model's maximum context length is {profile.max_model_len} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the "
            "completion). Please reduce the length of the messages or completion.",
            param="max_tokens",
        )
    if body.get("n", 1) != 1:
        raise EngineError("The simulated engine serves n=1 only.", param="n")
    min_tokens = body.get("min_tokens", 0)
    if not isinstance(min_tokens, int) or min_tokens < 0:
        raise EngineError("min_tokens must be a non-negative integer.", param="min_tokens")
    options = body.get("stream_options") or {}
    return _Params(
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        ignore_eos=bool(body.get("ignore_eos", False)),
        stream=bool(body.get("stream", False)),
        include_usage=isinstance(options, dict) and bool(options.get("include_usage")),
        kind=detect_kind(request_text(body)),
    )


class _Reply:
    """Turns the engine's per-step token counts into vLLM-format chunks or a whole response."""

    def __init__(self, model: str, chat: bool, params: _Params, generation: Generation, seed: int) -> None:
        self.model = model
        self.chat = chat
        self.params = params
        self.generation = generation
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        request = generation.request
        self._text: Iterator[str] = text_tokens(request.kind, random.Random(f"{seed}:{request.id}"))

    def _piece(self, count: int) -> str:
        return "".join(itertools.islice(self._text, count))

    def _finish_reason(self) -> str:
        request = self.generation.request
        return "length" if request.generated >= request.max_tokens else "stop"

    def _usage(self) -> dict[str, int]:
        completion = self.generation.request.generated
        prompt = self.params.prompt_tokens
        return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        payload = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        return b"data: " + json.dumps({**payload, **extra}, separators=(",", ":")).encode() + b"\n\n"

    def _choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        if self.chat:
            return {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish_reason}
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    async def stream(self) -> AsyncIterator[bytes]:
        if self.chat:
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            yield self._chunk([role])
        while (count := await self.generation.updates.get()) is not None:
            yield self._chunk([self._choice(self._piece(count), None)])
        yield self._chunk([self._choice("", self._finish_reason())])
        if self.params.include_usage:
            yield self._chunk([], usage=self._usage())
        yield b"data: [DONE]\n\n"

    async def whole(self) -> dict[str, Any]:
        pieces = []
        while (count := await self.generation.updates.get()) is not None:
            pieces.append(self._piece(count))
        text = "".join(pieces)
        finish_reason = self._finish_reason()
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self._usage(),
        }


async def _guarded(
    chunks: AsyncIterator[bytes], runner: EngineRunner, stats: _EngineStats, generation: Generation
) -> AsyncIterator[bytes]:
    """Pass chunks on; if the client leaves (the response is cancelled), abort and free the KV."""
    first = True
    try:
        async for chunk in chunks:
            if first and generation.request.first_token_at is not None:
                first = False
                stats.first_token(generation)
            yield chunk
    finally:
        runner.abort(generation)


async def _whole(
    request: Request, reply: _Reply, runner: EngineRunner, stats: _EngineStats, generation: Generation
) -> Response:
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
            runner.abort(generation)
    if not answer.done() or answer.cancelled():
        return Response(status_code=499)
    stats.first_token(generation)
    return JSONResponse(answer.result())


class _EngineStats(Collector):
    """vLLM's metrics, read from the engine model at scrape time, plus a TTFT histogram."""

    def __init__(self, runner: EngineRunner, model: str) -> None:
        self._runner = runner
        self._model = model
        self._ttft_counts = [0] * len(TTFT_BUCKETS)
        self._ttft_sum = 0.0
        self._ttft_n = 0

    def first_token(self, generation: Generation) -> None:
        request = generation.request
        if request.first_token_at is None:
            return
        ttft = request.first_token_at - request.arrival
        self._ttft_sum += ttft
        self._ttft_n += 1
        for i, bound in enumerate(TTFT_BUCKETS):
            if ttft <= bound:
                self._ttft_counts[i] += 1

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
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", counters.generation_tokens)
        yield counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", counters.spec_drafts)
        yield counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", counters.spec_draft_tokens)
        yield counter(
            "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", counters.spec_accepted_tokens
        )
        yield counter("vllm:request_success", "Count of successfully processed requests.", counters.finished)
        yield self._cache_config()
        histogram = _histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            self._model,
            self._ttft_counts,
            self._ttft_sum,
            self._ttft_n,
        )
        yield histogram
        yield GaugeMetricFamily(
            "specroute_sim_lag_seconds", "How far the simulation runs behind its time scale.", value=self._runner.lag
        )

    def _cache_config(self) -> Metric:
        """vLLM's `cache_config_info`: the KV cache's size, and how many requests it holds. vLLM
        states that for requests of `max_model_len`; the simulated engine reserves a request's
        prompt, its answer and the profile's overhead, so it states it for an answer of its
        default length."""
        profile = self._runner.engine.profile
        block = 16
        holds = profile.kv_cache_tokens / (profile.kv_overhead_tokens + profile.default_max_tokens)
        labels = {
            "block_size": str(block),
            "num_gpu_blocks": str(profile.kv_cache_tokens // block),
            "kv_cache_size_tokens": str(profile.kv_cache_tokens),
            "kv_cache_max_concurrency": f"{holds:.2f}",
        }
        family = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(labels)
        )
        family.add_metric(list(labels.values()), 1.0)
        return family


def _histogram(name: str, doc: str, model: str, counts: list[int], total: float, n: int) -> Metric:
    family = HistogramMetricFamily(name, doc, labels=["model_name"])
    buckets = [(str(bound), float(count)) for bound, count in zip(TTFT_BUCKETS, counts, strict=True)]
    buckets.append(("+Inf", float(n)))
    family.add_metric([model], buckets, total)
    return family
