#!/usr/bin/env python3
"""A minimal mock engine for scripts/bench_peers.py: vLLM's OpenAI stream format and nothing else.

Raw ASGI under uvicorn with uvloop and httptools, no framework, every chunk preformatted: the
engine must never be what a benchmark of the proxies in front of it measures. A chat completion
streams `max_tokens` chunks of one word each, as vLLM does: a role chunk first (empty content),
then one chunk per token (the last with `finish_reason`), the usage chunk if the request asked
for `stream_options.include_usage`, and `[DONE]`. With `--interval` each token waits that long
(per-token pacing); with 0 every token is written as fast as the socket takes it (saturation).

It also answers what routers ask an engine: /health, /v1/models, /metrics (vLLM names, the
live count of running requests), and sglang's /model_info and /server_info.

    python scripts/peers_engine.py --port 8001 [--interval 0.02]
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import uvicorn

MODEL = "mock-model"
Scope = dict[str, Any]


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _chunk(delta: dict[str, str], finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    if finish:
        choice["stop_reason"] = None
    return _event({"id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
                   "choices": [choice]})  # fmt: skip


ROLE = _chunk({"role": "assistant", "content": ""})
TOKEN = _chunk({"content": " word"})
LAST = _chunk({"content": " word"}, "length")
DONE = b"data: [DONE]\n\n"
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
JSON_HEADERS = [(b"content-type", b"application/json")]


def _usage(tokens: int) -> bytes:
    return _event({"id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
                   "choices": [], "usage": {"prompt_tokens": 8, "total_tokens": 8 + tokens,
                                            "completion_tokens": tokens}})  # fmt: skip


class Engine:
    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.running = 0

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["method"] == "POST":
            await self._complete(receive, send)
            return
        status, body = self._info(scope["path"])
        await send({"type": "http.response.start", "status": status, "headers": JSON_HEADERS})
        await send({"type": "http.response.body", "body": body})

    def _info(self, path: str) -> tuple[int, bytes]:
        if path == "/metrics":
            return 200, (
                f'vllm:num_requests_running{{model_name="{MODEL}"}} {self.running}\n'
                f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 0\n'
                f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} {self.running / 4096}\n'
            ).encode()
        if path == "/v1/models":
            return 200, json.dumps(
                {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "mock"}]}
            ).encode()
        if path in ("/model_info", "/get_model_info"):
            return 200, json.dumps({"model_path": MODEL, "tokenizer_path": MODEL, "is_generation": True}).encode()
        if path in ("/health", "/server_info", "/get_server_info", "/health_generate"):
            return 200, b"{}"
        return 404, b'{"error": "not found"}'

    async def _complete(self, receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = json.loads(body)
        # sglang-router forwards `max_tokens` as `max_completion_tokens`; vLLM takes either.
        tokens = int(request.get("max_completion_tokens") or request.get("max_tokens") or 16)
        usage = bool((request.get("stream_options") or {}).get("include_usage"))
        self.running += 1
        try:
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            await send({"type": "http.response.body", "body": ROLE, "more_body": True})
            for i in range(tokens):
                if self.interval:
                    await asyncio.sleep(self.interval)
                await send(
                    {"type": "http.response.body", "body": LAST if i == tokens - 1 else TOKEN, "more_body": True}
                )
            tail = (_usage(tokens) if usage else b"") + DONE
            await send({"type": "http.response.body", "body": tail, "more_body": False})
        finally:
            self.running -= 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--interval", type=float, default=0.0, help="seconds per token; 0: as fast as it can")
    args = parser.parse_args()
    uvicorn.run(Engine(args.interval), host="127.0.0.1", port=args.port, loop="uvloop", http="httptools",
                log_level="warning", access_log=False, lifespan="off", backlog=4096)  # fmt: skip


if __name__ == "__main__":
    main()
