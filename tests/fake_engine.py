"""A small OpenAI-compatible engine for the router's tests and the soak, in vLLM's stream format.

It records every request it receives and counts the requests it is still serving, so a test
can see what was forwarded and whether a cancelled request was closed upstream. Every answer
carries the request's own `X-Request-Id` in its `id` (`cmpl-<id>`), so a client can tell its
answer from another request's, and echoes it in its `X-Request-Id` header, as vLLM does with
`--enable-request-id-headers` (`echo_request_id=False`: as vLLM does without). Faults are set by
a test (`fail_status`, `die_after`, ...) or drawn per request (`chaos`, for the soak); faults on
the wire itself (interim 1xx answers, answers nobody asked for) need the engine served by
tests/wire.py instead of uvicorn.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from starlette.applications import Starlette
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tests.wait import TIMEOUT, wait_until

Fault = Literal["503", "die", "stall"]


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]  # the JSON body ({} for one that is not JSON)
    method: str = "POST"
    raw: bytes = b""  # the body as it arrived


@dataclass(frozen=True)
class Chaos:
    """Faults drawn per request, each with its share of the requests."""

    shares: dict[Fault, float] = field(default_factory=lambda: {"503": 0.03, "die": 0.02, "stall": 0.01})
    seed: int | None = None


@dataclass
class FakeEngine:
    model: str = "test-model"
    token_delay: float = 0.0  # seconds between streamed tokens
    first_token_delay: float = 0.0
    requests: list[Seen] = field(default_factory=list)
    open: int = 0  # requests being served right now
    most_open: int = 0  # the most it ever served at once
    aborted: int = 0  # requests whose client went away before the end
    healthy: bool = True
    health_checks: int = 0  # GET /health answered
    probe_delay: float = 0.0  # /health, /metrics and /v1/models answer after this many seconds
    models_served: int = 0  # GET /v1/models answered
    # Faults, for the reliability tests.
    fail_status: int | None = None  # answer this status instead...
    fail_count: int = -1  # ...this many times (-1: always)
    fail_delay: float = 0.0  # ...after this many seconds
    gate: threading.Event | None = None  # whole and failure answers wait until it is set
    stream_gate: threading.Event | None = None  # streams wait until it is set (a chat's after its role event)
    die_after: int | None = None  # drop the connection after this many streamed tokens
    stall_after: int | None = None  # go silent after this many streamed tokens
    script: list[bytes] | None = None  # stream exactly these pieces, each its own write
    metrics: str | None = None  # what GET /metrics answers (None: 404, as an engine without it)
    metrics_served: int = 0
    chaos: Chaos | None = None  # draw a fault per request
    record: bool = True  # keep every request in `requests` (a soak counts them in `stats` only)
    models_answer: Any = None  # answer /v1/models with this JSON (bytes: these) instead of the model list
    stats: Counter[str] = field(default_factory=Counter)  # requests, faults drawn, aborted
    echo_request_id: bool = True
    name: str = ""  # in the ids of its stored responses (`resp-<name><n>`), to tell engines apart
    stored: dict[str, dict[str, Any]] = field(default_factory=dict)  # stored responses, by id
    stored_delay: float = 0.0  # seconds before answering GET/DELETE /v1/responses/{id}

    def __post_init__(self) -> None:
        self._rng = random.Random(self.chaos.seed if self.chaos else None)

    def wait_idle(self, timeout: float = TIMEOUT) -> bool:
        wait_until(lambda: self.open == 0, timeout=timeout, message="the engine idle")
        return True

    def app(self) -> Starlette:
        return Starlette(
            middleware=[Middleware(_EchoRequestId)] if self.echo_request_id else [],
            routes=[
                Route("/v1/chat/completions", self._generate, methods=["POST"]),
                Route("/v1/completions", self._generate, methods=["POST"]),
                Route("/v1/embeddings", self._embeddings, methods=["POST"]),
                Route("/v1/responses", self._responses, methods=["POST"]),
                Route("/v1/responses/{id}", self._stored_response, methods=["GET", "DELETE"]),
                Route("/v1/responses/{id}/input_items", self._input_items, methods=["GET"]),
                Route("/v1/audio/transcriptions", self._transcriptions, methods=["POST"]),
                Route("/v1/models", self._models),
                Route("/v1/fine_tuning/jobs/{id}", self._job, methods=["GET"]),  # a GET the router forwards
                Route("/health", self._health),
                Route("/metrics", self._metrics),
                Route("/stats", self._stats),
            ],
        )

    async def _record(self, request: Request) -> dict[str, Any]:
        raw = await request.body()
        try:
            body: dict[str, Any] = json.loads(raw)
        except ValueError as exc:  # as vLLM: a body that is not JSON is the client's error
            raise HTTPException(400, "the body is not JSON") from exc
        if not isinstance(body, dict):
            raise HTTPException(400, "the body is not a JSON object")
        self.stats["requests"] += 1
        if self.record:
            self.requests.append(Seen(request.url.path, dict(request.headers), body, request.method, raw))
        if not isinstance(body.get("model"), str):
            # Like an engine: a request it cannot read is the client's error, not its own.
            raise HTTPException(400, "model must be a string")
        return body

    async def _health(self, request: Request) -> Response:
        await asyncio.sleep(self.probe_delay)
        self.health_checks += 1
        return Response(status_code=200 if self.healthy else 503)

    async def _metrics(self, request: Request) -> Response:
        await asyncio.sleep(self.probe_delay)
        if self.metrics is None:
            return Response(status_code=404)
        self.metrics_served += 1
        return Response(self.metrics, media_type="text/plain; version=0.0.4")

    async def _stats(self, request: Request) -> Response:
        return JSONResponse({**self.stats, "open": self.open, "aborted": self.aborted})

    def _draw(self) -> Fault | None:
        if self.chaos is None:
            return None
        draw = self._rng.random()
        for fault, share in self.chaos.shares.items():
            if draw < share:
                self.stats[fault] += 1
                return fault
            draw -= share
        return None

    async def _models(self, request: Request) -> Response:
        await asyncio.sleep(self.probe_delay)
        self.models_served += 1
        if isinstance(self.models_answer, bytes):
            return Response(self.models_answer, media_type="application/json")
        if self.models_answer is not None:
            return JSONResponse(self.models_answer)
        return JSONResponse(
            {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "fake"}]}
        )

    async def _embeddings(self, request: Request) -> Response:
        body = await self._record(request)
        return JSONResponse(
            {
                "object": "list",
                "model": body["model"],
                "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2, 0.3]}],
                "usage": {"prompt_tokens": 3, "total_tokens": 3},
            }
        )

    def _seen(self, request: Request, raw: bytes, body: dict[str, Any] | None = None) -> None:
        self.stats["requests"] += 1
        if self.record:
            self.requests.append(Seen(request.url.path, dict(request.headers), body or {}, request.method, raw))

    async def _responses(self, request: Request) -> Response:
        body = await self._record(request)
        previous = body.get("previous_response_id")
        if previous is not None and previous not in self.stored:
            return _not_found(f"Response with id '{previous}' not found.")
        response_id = f"resp-{self.name}{len(self.stored) + 1}"
        text = {"type": "output_text", "text": "hello", "annotations": []}
        message = {"type": "message", "id": "msg-1", "role": "assistant", "status": "completed", "content": [text]}
        answer = {
            "id": response_id,
            "object": "response",
            "created_at": 0,
            "model": body["model"],
            "status": "completed",
            "output": [message],
            "parallel_tool_calls": False,
            "tool_choice": "auto",
            "tools": [],
            "usage": {"input_tokens": 3, "output_tokens": 1, "total_tokens": 4},
        }
        self.stored[response_id] = {**answer, "input": body.get("input")}
        if body.get("stream"):
            return StreamingResponse(_response_events(answer), media_type="text/event-stream")
        return JSONResponse(answer)

    async def _stored_response(self, request: Request) -> Response:
        self._seen(request, await request.body())
        await asyncio.sleep(self.stored_delay)
        response_id = request.path_params["id"]
        stored = self.stored.get(response_id)
        if stored is None:
            return _not_found(f"Response with id '{response_id}' not found.")
        if request.method == "DELETE":
            del self.stored[response_id]
            return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
        return JSONResponse({k: v for k, v in stored.items() if k != "input"})

    async def _input_items(self, request: Request) -> Response:
        self._seen(request, await request.body())
        stored = self.stored.get(request.path_params["id"])
        if stored is None:
            return _not_found("Response not found.")
        item = {"id": "in-1", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "x"}]}
        page = {"object": "list", "data": [item], "first_id": "in-1", "last_id": "in-1", "has_more": False}
        return JSONResponse(page)

    async def _transcriptions(self, request: Request) -> Response:
        raw = await request.body()
        self._seen(request, raw)
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise HTTPException(400, "expected multipart/form-data")
        if b'name="stream"\r\n\r\ntrue' in raw:  # vLLM's `stream=true` form field: transcription chunks
            return StreamingResponse(self._transcription_chunks(len(raw)), media_type="text/event-stream")
        return JSONResponse({"text": f"{len(raw)} bytes heard"})

    async def _transcription_chunks(self, size: int) -> AsyncIterator[str]:
        """vLLM's streamed transcription: `transcription.chunk` deltas, then usage, then [DONE]."""
        chunk = {"id": "trsc-1", "object": "transcription.chunk", "created": 0, "model": self.model}
        yield _event({**chunk, "choices": [{"delta": {"content": f"{size} bytes"}}]})
        if self.stream_gate is not None:
            await asyncio.to_thread(self.stream_gate.wait, TIMEOUT)
        yield _event({**chunk, "choices": [{"delta": {"content": " heard"}, "finish_reason": "stop"}]})
        usage = {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}
        yield _event({**chunk, "choices": [], "usage": usage})
        yield "data: [DONE]\n\n"

    async def _job(self, request: Request) -> Response:
        self._seen(request, await request.body())
        return JSONResponse({"id": request.path_params["id"], "object": "fine_tuning.job", "model": self.model})

    async def _generate(self, request: Request) -> Response:
        body = await self._record(request)
        fault = self._draw()
        failing = self.fail_status is not None and self.fail_count != 0
        if failing:
            self.fail_count -= 1
        if failing or fault == "503":
            await asyncio.sleep(self.fail_delay if failing else 0.0)
            if self.gate is not None:
                await asyncio.to_thread(self.gate.wait, TIMEOUT)
            error = {"message": "overloaded", "type": "ServiceUnavailableError", "param": None, "code": 503}
            return JSONResponse({"error": error}, status_code=self.fail_status or 503)
        if body.get("model") != self.model:
            return JSONResponse(
                {
                    "error": {
                        "message": f"The model `{body.get('model')}` does not exist.",
                        "type": "NotFoundError",
                        "param": None,
                        "code": 404,
                    }
                },
                status_code=404,
            )
        chat = request.url.path.endswith("chat/completions")
        answer_id = f"cmpl-{request.headers.get('x-request-id', '1')}"
        tokens = body.get("max_tokens") or 8
        options = body.get("stream_options") or {}
        if (
            not isinstance(tokens, int)
            or not isinstance(options, dict)
            or not isinstance(body.get("stream", False), bool)
        ):
            raise HTTPException(400, "bad max_tokens, stream or stream_options")
        if self.script is not None:
            return StreamingResponse(self._scripted(self.script), media_type="text/event-stream")
        if body.get("stream"):
            usage = bool(options.get("include_usage"))
            die_at, stall_at = self.die_after, self.stall_after
            if fault in ("die", "stall") and tokens > 1:
                at = self._rng.randrange(1, tokens)
                die_at, stall_at = (at, None) if fault == "die" else (None, at)
            stream = self._stream(answer_id, chat, tokens, usage, die_at=die_at, stall_at=stall_at)
            return _ClosingStream(stream, media_type="text/event-stream")
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            # A plain endpoint is not cancelled when its client leaves: look, as engines do.
            deadline = time.monotonic() + self.first_token_delay + self.token_delay * tokens
            gate = self.gate
            while time.monotonic() < deadline or (gate is not None and not gate.is_set()):
                if await request.is_disconnected():
                    self.aborted += 1
                    return Response(status_code=499)
                await asyncio.sleep(0.01 if gate is not None else min(0.01, max(0.0, deadline - time.monotonic())))
        finally:
            self.open -= 1
        text = " ".join(f"w{i}" for i in range(tokens))
        choice: dict[str, Any] = (
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
            if chat
            else {"index": 0, "text": text, "finish_reason": "length"}
        )
        return JSONResponse(
            {
                "id": answer_id,
                "object": "chat.completion" if chat else "text_completion",
                "created": 0,
                "model": self.model,
                "choices": [choice],
                "usage": {"prompt_tokens": 5, "completion_tokens": tokens, "total_tokens": 5 + tokens},
            }
        )

    async def _scripted(self, pieces: list[bytes]) -> AsyncIterator[bytes]:
        for piece in pieces:
            yield piece
            await asyncio.sleep(0.002)  # a write of its own, and most often a TCP segment of its own

    async def _stream(
        self, answer_id: str, chat: bool, tokens: int, usage: bool, *, die_at: int | None, stall_at: int | None
    ) -> AsyncIterator[str]:
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        finished = False
        try:
            base = {"id": answer_id, "created": 0, "model": self.model}
            kind = "chat.completion.chunk" if chat else "text_completion"
            if chat:
                yield _event({**base, "object": kind, "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            if self.stream_gate is not None:
                await asyncio.to_thread(self.stream_gate.wait, TIMEOUT)
            await asyncio.sleep(self.first_token_delay)
            for i in range(tokens):
                if i == die_at:
                    raise ConnectionAbortedError("fake engine dies mid-stream")
                if i == stall_at:
                    await asyncio.sleep(3600)
                if i:
                    await asyncio.sleep(self.token_delay)
                piece = f"w{i} "
                choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
                yield _event({**base, "object": kind, "choices": [choice]})
            last: dict[str, Any] = {"index": 0, "finish_reason": "length", **({"delta": {}} if chat else {"text": ""})}
            yield _event({**base, "object": kind, "choices": [last]})
            if usage:
                counts = {"prompt_tokens": 5, "completion_tokens": tokens, "total_tokens": 5 + tokens}
                yield _event({**base, "object": kind, "choices": [], "usage": counts})
            yield "data: [DONE]\n\n"
            finished = True
        finally:
            if not finished:
                self.aborted += 1
            self.open -= 1


class _ClosingStream(StreamingResponse):
    """A stream whose generator is closed as soon as the response ends, however it ends. Starlette
    leaves it suspended when a write fails (the router closed the connection as the engine wrote),
    to be finalized whenever the garbage collector gets to it; until then `open` counted a request
    whose connection was long gone (seen in the soak: generators held at a `yield`, no connection)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            body = self.body_iterator
            if isinstance(body, AsyncGenerator):
                await body.aclose()


def _not_found(message: str) -> JSONResponse:
    error = {"message": message, "type": "NotFoundError", "param": None, "code": 404}
    return JSONResponse({"error": error}, status_code=404)


async def _response_events(answer: dict[str, Any]) -> AsyncIterator[str]:
    """The Responses API's stream, as vLLM sends it: typed events, the id in the first."""
    started = {**answer, "status": "in_progress", "output": [], "usage": None}
    yield _event({"type": "response.created", "sequence_number": 0, "response": started})
    delta = {"type": "response.output_text.delta", "sequence_number": 1, "item_id": "msg-1"}
    yield _event({**delta, "output_index": 0, "content_index": 0, "delta": "hello", "logprobs": []})
    yield _event({"type": "response.completed", "sequence_number": 2, "response": answer})


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class _EchoRequestId:
    """As vLLM's `XRequestIdMiddleware`: an answer carries the `X-Request-Id` of its request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = Headers(scope=scope).get("x-request-id") if scope["type"] == "http" else None

        async def echo(message: Message) -> None:
            if message["type"] == "http.response.start" and request_id is not None:
                MutableHeaders(scope=message).append("x-request-id", request_id)
            await send(message)

        await self.app(scope, receive, echo)
