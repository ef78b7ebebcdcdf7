"""Relay, the fourth stage: an engine's answer to the client, whole or as a stream.

A stream's bytes go from the upstream socket to the client with nothing in between but one
`StreamWatch.feed`, which counts tokens, spots the first token and drops the usage chunk the
router asked for. Served by the router's own listener, each piece goes in the engine
connection's callbacks straight to the client's connection (`ClientStream`), with flow control
by pausing reading on the engine's side; otherwise (an in-process caller) through ASGI `send`.
Once a byte has gone to the client nothing is retried: a stream that breaks or goes silent ends
with one error event.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import Send

from router import sse
from router.request.headers import response_headers
from router.server.uvicorn_private import ClientStream
from router.transport import Response, TooLarge, TransportError


@dataclass(frozen=True, slots=True)
class Outcome:
    status: int
    code: str | None = None  # the router's error code, when it ended the stream with one
    tokens: int | None = None
    prompt_tokens: int | None = None
    response_id: str | None = None  # the answer's `id` (a stored response's, for router.affinity)


@dataclass(slots=True)
class Progress:
    """How far a relay got, for a request ended under way (client gone, shutdown)."""

    streaming: bool = False  # the answer's head has gone to the client (whole or streamed): no error answer now
    ttft: float | None = None


async def relay_whole(
    send: Send, response: Response, content: bytes, route_headers: dict[str, str], progress: Progress
) -> Outcome:
    tokens = prompt_tokens = answer_id = None
    if response.status < 400 and (response.header(b"content-type") or b"").startswith(b"application/json"):
        try:
            answer = json.loads(content)
            usage, answer_id = answer.get("usage"), answer.get("id")
        except (ValueError, AttributeError, RecursionError):
            usage = None
        tokens, prompt_tokens = sse.completion_tokens(usage), sse.prompt_tokens(usage)
    headers = response_headers(response.headers, route_headers)
    headers.append((b"content-length", str(len(content)).encode()))
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    progress.streaming = True
    await send({"type": "http.response.body", "body": content})
    response_id = answer_id if isinstance(answer_id, str) else None
    return Outcome(response.status, tokens=tokens, prompt_tokens=prompt_tokens, response_id=response_id)


async def relay_stream(
    send: Send,
    response: Response,
    route_headers: dict[str, str],
    progress: Progress,
    *,
    drop_usage_chunk: bool,
    max_event: int,
    first_token: Callable[[], float],
    broken: Callable[[TransportError], tuple[int, str | None, bytes]],
    client: ClientStream | None = None,
) -> Outcome:
    """`first_token()` records the first token and returns its time; `broken(exc)` records a
    failure under way and returns the status and code to log and the error event to end with;
    `client`: the client's connection, to write the pieces to directly."""
    watch = sse.StreamWatch(drop_usage_chunk=drop_usage_chunk, max_event=max_event)
    headers = response_headers(response.headers, route_headers)
    start = {"type": "http.response.start", "status": response.status, "headers": headers}
    if client is None:
        await send(start)
    else:
        await client.through(send, start)  # the head goes out with the pieces already here
    progress.streaming = True
    status, code = response.status, None
    try:
        if client is not None and client.ready():
            await _pipe(response, client, watch, progress, first_token)
        else:
            if client is not None:
                client.flush()
            async for chunk in response.iter_raw():
                out = watch.feed(chunk)
                if watch.saw_content and progress.ttft is None:
                    progress.ttft = first_token()
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
        tail = watch.flush()
    except (TransportError, sse.EventTooLarge) as exc:
        status, code, tail = broken(exc if isinstance(exc, TransportError) else TooLarge(str(exc)))
    except BaseException:
        if client is not None:
            client.flush()  # what the last read brought, before whatever ends the stream
        raise
    end = {"type": "http.response.body", "body": tail, "more_body": False}
    if client is None:
        await send(end)
    else:
        await client.through(send, end)  # with the last read's pieces
        client.flush()
    return Outcome(status, code, watch.completion_tokens, sse.prompt_tokens(watch.usage), watch.response_id)


async def _pipe(
    response: Response,
    client: ClientStream,
    watch: sse.StreamWatch,
    progress: Progress,
    first_token: Callable[[], float],
) -> None:
    """The body, piece by piece in the engine connection's callbacks, to the client's connection;
    the engine is not read while the client takes nothing."""

    def piece(data: bytes) -> None:
        out = watch.feed(data)
        if watch.saw_content and progress.ttft is None:
            progress.ttft = first_token()
        if out:
            client.write(out)  # gathered: written once the read is over (its flush may pause, flow below)

    def flow(paused: bool) -> None:
        if paused:
            response.pause_reading()
        else:
            response.resume_reading()

    client.listen(flow)
    try:
        if client.paused:
            response.pause_reading()
        await response.stream_to(piece, client.flush)
    finally:
        client.listen(None)
