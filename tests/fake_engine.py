"""A small OpenAI-compatible engine for the router's tests, speaking vLLM's stream format.

It records every request it receives and counts the requests it is still serving, so a test
can see what was forwarded and whether a cancelled request was closed upstream.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class FakeEngine:
    model: str = "test-model"
    token_delay: float = 0.0  # seconds between streamed tokens
    first_token_delay: float = 0.0
    requests: list[Seen] = field(default_factory=list)
    open: int = 0  # requests being served right now
    aborted: int = 0  # requests whose client went away before the end
    healthy: bool = True
    # Faults, for the reliability tests.
    fail_status: int | None = None  # answer this status instead...
    fail_count: int = -1  # ...this many times (-1: always)
    die_after: int | None = None  # drop the connection after this many streamed tokens
    stall_after: int | None = None  # go silent after this many streamed tokens
    script: list[bytes] | None = None  # stream exactly these pieces, each its own write
    metrics: str | None = None  # what GET /metrics answers (None: 404, as an engine without it)
    metrics_served: int = 0

    def wait_idle(self, timeout: float = 1.0) -> bool:
        deadline = time.monotonic() + timeout
        while self.open and time.monotonic() < deadline:
            time.sleep(0.005)
        return self.open == 0

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/chat/completions", self._generate, methods=["POST"]),
                Route("/v1/completions", self._generate, methods=["POST"]),
                Route("/v1/embeddings", self._embeddings, methods=["POST"]),
                Route("/v1/responses", self._responses, methods=["POST"]),
                Route("/v1/models", self._models),
                Route("/health", self._health),
                Route("/metrics", self._metrics),
            ]
        )

    async def _record(self, request: Request) -> dict[str, Any]:
        body: dict[str, Any] = await request.json()
        self.requests.append(Seen(request.url.path, dict(request.headers), body))
        if not isinstance(body.get("model"), str):
            # Like an engine: a request it cannot read is the client's error, not its own.
            raise HTTPException(400, "model must be a string")
        return body

    async def _health(self, request: Request) -> Response:
        return Response(status_code=200 if self.healthy else 503)

    async def _metrics(self, request: Request) -> Response:
        if self.metrics is None:
            return Response(status_code=404)
        self.metrics_served += 1
        return Response(self.metrics, media_type="text/plain; version=0.0.4")

    async def _models(self, request: Request) -> Response:
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

    async def _responses(self, request: Request) -> Response:
        body = await self._record(request)
        return JSONResponse({"id": "resp-1", "object": "response", "model": body["model"], "output": []})

    async def _generate(self, request: Request) -> Response:
        body = await self._record(request)
        if self.fail_status is not None and self.fail_count != 0:
            self.fail_count -= 1
            error = {"message": "overloaded", "type": "ServiceUnavailableError", "param": None, "code": 503}
            return JSONResponse({"error": error}, status_code=self.fail_status)
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
            return StreamingResponse(self._stream(chat, tokens, usage), media_type="text/event-stream")
        self.open += 1
        try:
            # A plain endpoint is not cancelled when its client leaves: look, as engines do.
            deadline = time.monotonic() + self.first_token_delay + self.token_delay * tokens
            while time.monotonic() < deadline:
                if await request.is_disconnected():
                    self.aborted += 1
                    return Response(status_code=499)
                await asyncio.sleep(min(0.01, max(0.0, deadline - time.monotonic())))
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
                "id": "cmpl-1",
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

    async def _stream(self, chat: bool, tokens: int, usage: bool) -> AsyncIterator[str]:
        self.open += 1
        finished = False
        try:
            base = {"id": "cmpl-1", "created": 0, "model": self.model}
            kind = "chat.completion.chunk" if chat else "text_completion"
            if chat:
                yield _event({**base, "object": kind, "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            await asyncio.sleep(self.first_token_delay)
            for i in range(tokens):
                if i == self.die_after:
                    raise ConnectionAbortedError("fake engine dies mid-stream")
                if i == self.stall_after:
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


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"
