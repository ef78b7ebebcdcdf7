"""An in-process HTTP client for the router's own request path, as httpx's ASGI transport is for
an app: the batch runner's lines go through the pipeline exactly as a client's requests do.

The request is marked as the router's own (`INTERNAL_SCOPE_KEY`), and asks for the
`specroute.admitted` extension: the pipeline sends that message once the request has entered a
pool (it holds a slot or waits in the pool's queue), so the caller knows when the pools count it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.types import ASGIApp, Message

from router.auth import INTERNAL_SCOPE_KEY
from router.request.pipeline import ADMITTED


@dataclass(frozen=True, slots=True)
class Reply:
    status: int  # 0: the path ended without answering
    body: bytes


class InProcessClient:
    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def post(
        self, path: str, body: bytes, *, headers: list[tuple[bytes, bytes]], admitted: Callable[[], None]
    ) -> Reply:
        """POST `body` to `path`; `admitted` is called once, when the request enters a pool."""
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(b"content-length", str(len(body)).encode()), *headers],
            "client": ("specroute-batch", 0),
            "server": None,
            "extensions": {ADMITTED: {}},
            INTERNAL_SCOPE_KEY: True,
        }
        sent = False
        never = anyio.Event()  # this caller does not hang up: the pipeline's disconnect watch waits

        async def receive() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await never.wait()
            return {"type": "http.disconnect"}

        status = 0
        chunks: list[bytes] = []

        async def send(message: Message) -> None:
            nonlocal status
            if message["type"] == ADMITTED:
                admitted()
            elif message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self._app(scope, receive, send)
        return Reply(status, b"".join(chunks))
