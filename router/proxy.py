"""The forwarding path, top to bottom.

check key -> read body -> classify -> choose pool -> admit (maybe queue) -> send upstream
(again elsewhere, if it fails before the first byte) -> stream back while measuring ->
release -> learn -> access log.

It is a plain ASGI app rather than a Starlette endpoint so that the bytes of a stream go from
the upstream socket to the client socket with nothing in between but one `StreamWatch.feed`,
and so that a client's disconnect cancels the upstream request at once, wherever it is.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, NoReturn, TypeVar

import anyio
import anyio.lowlevel
from starlette.types import Message, Receive, Scope, Send
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, stop_after_delay

from router import logs, sse
from router.auth import INTERNAL_SCOPE_KEY, Auth
from router.classify import Classifier, RequestFacts, client_id
from router.config import Settings
from router.content import ContentKind, detect_kind, request_text
from router.errors import (
    BadRequest,
    NoBackendAvailable,
    RouterError,
    ShuttingDown,
    UpstreamError,
    UpstreamTimeout,
)
from router.headers import bearer, request_headers, response_headers
from router.learn import SpeedModel
from router.metrics import Metrics
from router.payload import ClientGone as BodyClientGone
from router.payload import parse_json, read_body
from router.policy import Decision, Policy
from router.pools import Backend, Clients, Pools
from router.transport import (
    ConnectError,
    HeadLimits,
    NotSent,
    ReadTimeout,
    Response,
    Timeouts,
    TlsError,
    TooLarge,
    Transport,
    TransportError,
    WrongAnswer,
)

logger = logging.getLogger("specroute")
access_log = logging.getLogger("specroute.access")
T = TypeVar("T")

# Control characters (C0 and DEL), which no path has once decoded.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# Paths whose streams accept `stream_options.include_usage`.
_USAGE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
# Upstream answers that mean "not now, try elsewhere" (RFC 9110 §15.6), retried before the first byte.
_RETRYABLE_STATUS = frozenset({502, 503, 504})
# Requests sent again to the same backend when the engine had closed the pooled connection before
# any byte was written (NotSent). Each such attempt discards one closed connection; more in a
# row mean the engine closes connections as they open, a failure like any other.
_NOT_SENT_RESENDS = 3


class ClientGone(Exception):
    """The client closed its connection."""


class _Retry(Exception):
    """A failure before any byte reached the client, to be tried again elsewhere."""

    def __init__(self, error: RouterError) -> None:
        super().__init__(error.message)
        self.error = error


@dataclass(slots=True)
class Call:
    """One request on its way through the router, and what happened to it."""

    request_id: str
    path: str  # percent-decoded, for the router's own decisions
    target: str  # the path and query exactly as the client sent them, forwarded as they are
    headers: dict[str, str]  # lower-cased names
    started: float = field(default_factory=time.perf_counter)
    payload: dict[str, Any] = field(default_factory=dict)
    body: bytes = b""  # as received; emptied when the payload must be re-encoded
    decision: Decision | None = None
    backend: Backend | None = None
    concurrency: int = 0  # requests on the backend when this one was sent, itself included
    status: int = 0
    streaming: bool = False  # an event stream has started to the client
    ttft: float | None = None
    tokens: int | None = None
    prompt_tokens: int | None = None
    code: str | None = None  # the router's error code, when it answered or ended the request with one
    client: str | None = None  # who sent it (classify.client_id); logged only as a hash
    queue_wait: float = 0.0  # seconds in pool queues, over all attempts
    attempts: int = 0  # sent upstream this many times (1 + retries)


class Proxy:
    def __init__(
        self,
        settings: Settings,
        *,
        pools: Pools,
        clients: Clients,
        speeds: SpeedModel,
        metrics: Metrics,
        transport: Transport,
        auth: Auth,
    ) -> None:
        self._pools = pools
        self._clients = clients
        self._speeds = speeds
        self._metrics = metrics
        self._transport = transport
        self._retrying = 0  # attempts under way that are retries, for the retry budget
        self._serving: set[anyio.CancelScope] = set()  # one per request being served
        self.configure(settings, auth)

    def configure(self, settings: Settings, auth: Auth) -> None:
        """Take (re)loaded settings; requests already under way keep their decision."""
        self._settings = settings
        self._auth = auth
        self._classifier = Classifier(
            settings.classify,
            pool_header=settings.headers.pool,
            job_header=settings.headers.job,
            pools=set(settings.pools),
        )
        self._policy = Policy(
            settings.routing,
            interactive_pool=settings.pool_for("interactive"),
            batch_pool=settings.pool_for("batch"),
        )
        self._override_headers = frozenset({settings.headers.pool.lower(), settings.headers.job.lower()})
        self._code_hints = tuple(settings.classify.code_hints)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        call = Call(headers.get("x-request-id") or uuid.uuid4().hex, scope["path"], _raw_target(scope), headers)
        client = None
        try:
            _check_path(call.path)
            api_key = bearer(headers.get("authorization"))
            if scope.get(INTERNAL_SCOPE_KEY) is not True:  # the router's own batch lines are trusted
                self._auth.check_client(api_key)  # before the body is read
                for name in self._override_headers:
                    if name in headers and not self._auth.may_override(api_key, name):
                        del headers[name]  # from this client it means nothing
            call.body = await self._read_body(headers, receive)
            call.payload = payload = self._parse_json(call.body)
            user = _field(payload, "user", str)
            address = scope["client"][0] if scope.get("client") else None
            call.client = client = client_id(api_key if self._auth.required else None, user, address)
            self._clients.start(client)
            await self._clients.settle(client)
            facts = RequestFacts(
                headers=headers,
                api_key=api_key,
                model=_field(payload, "model", str),
                user=user,
                metadata=_field(payload, "metadata", dict) or {},
                n=_field(payload, "n", int) or 1,
                client_load=self._clients.load(client) - 1,  # the others, not this one
            )
            classification = self._classifier.classify(facts)
            state = self._pools.snapshot(self._speeds, self._settings)
            call.decision = decision = self._policy.decide(classification, self._content(payload), state)
            self._metrics.decisions.labels(decision.job, decision.pool, decision.reason, decision.content).inc()
            if classification.rewrite_model is not None:
                payload["model"] = classification.rewrite_model
                call.body = b""  # re-encode below
            await self._serve_until_disconnect(receive, send, call)
        except ClientGone:
            call.status = 499
        except RouterError as exc:
            call.status, call.code = exc.status_code, exc.code
            await _send_response(send, exc.response(self._route_headers(call)))
        finally:
            if client is not None:
                self._clients.finish(client)
            self._finish(call)

    def _parse_json(self, body: bytes) -> dict[str, Any]:
        payload = parse_json(body, max_depth=self._settings.limits.json_depth)
        if not isinstance(payload, dict):
            raise BadRequest("request body must be a JSON object", code="invalid_json")
        return payload

    def _content(self, payload: dict[str, Any]) -> ContentKind:
        if payload.get("tools") or payload.get("functions"):
            return "code"  # tool calls are structured output, which a drafter guesses well
        return detect_kind(request_text(payload), hints=self._code_hints)

    async def _read_body(self, headers: dict[str, str], receive: Receive) -> bytes:
        try:
            return await read_body(
                receive,
                limit=self._settings.max_body_bytes,
                within=self._settings.timeouts.client_body,
                declared=headers.get("content-length"),
            )
        except BodyClientGone as exc:  # the same event, as this module names it
            raise ClientGone from exc

    async def _serve_until_disconnect(self, receive: Receive, send: Send, call: Call) -> None:
        """Serve the request, cancelling everything (queue wait, upstream) if the client leaves."""
        gone = served = False
        error: RouterError | None = None

        async def watch(cancel: anyio.CancelScope) -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            cancel.cancel()

        async def send_while_there(message: Message) -> None:
            if gone:
                # uvicorn drops what is sent to a client that left without suspending, so a relay
                # from an engine that streams fast might never reach a point where the cancel lands.
                await anyio.lowlevel.checkpoint()
            await send(message)

        async with anyio.create_task_group() as group:
            group.start_soon(watch, group.cancel_scope)
            self._serving.add(group.cancel_scope)
            try:
                await self._serve(send_while_there, call)
                served = True
            except RouterError as exc:
                error = exc  # raised outside the group, which would wrap it in an ExceptionGroup
            finally:
                self._serving.discard(group.cancel_scope)
            group.cancel_scope.cancel()
        if gone and not served:  # a client that hangs up after the last byte was served
            raise ClientGone
        if error is not None:
            raise error
        if not served:  # ended by `end_all`
            await self._end_for_shutdown(send, call)

    def end_all(self) -> None:
        """End every request being served: at the end of a shutdown's grace period."""
        for scope in self._serving:
            scope.cancel()

    async def _end_for_shutdown(self, send: Send, call: Call) -> None:
        error = ShuttingDown("the router is shutting down; send the request again", code="shutting_down")
        call.status, call.code = error.status_code, error.code
        if not call.streaming:
            raise error  # nothing has gone to the client yet
        # Like a stream whose upstream failed: the events so far, one error event, no [DONE].
        await send({"type": "http.response.body", "body": error.event(), "more_body": False})

    async def _serve(self, send: Send, call: Call) -> None:
        """Send the request upstream; before any byte has gone to the client, try again elsewhere."""
        body, drop_usage_chunk = self._upstream_body(call)
        config = self._settings.retries
        tried: set[str] = set()
        retrying = AsyncRetrying(
            stop=stop_after_attempt(config.attempts) | stop_after_delay(config.deadline),
            retry=retry_if_exception_type(_Retry),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    if tried:
                        self._reroute(call, frozenset(tried))
                    last = attempt.retry_state.attempt_number >= config.attempts
                    await self._attempt(send, call, body, drop_usage_chunk, tried, last=last)
        except _Retry as exc:  # the deadline ran out between a failure and its retry
            raise exc.error from exc

    async def _attempt(
        self, send: Send, call: Call, body: bytes, drop_usage_chunk: bool, tried: set[str], *, last: bool
    ) -> None:
        assert call.decision is not None
        retry = bool(tried)
        pool = self._pools.get(call.decision.pool)
        if pool is None:  # removed by a reload while this request waited to be retried
            raise NoBackendAvailable(f"pool {call.decision.pool!r} is no longer configured", code="pool_unavailable")
        queued_at = time.perf_counter()
        backend = await pool.acquire(call.decision.job, exclude=frozenset(tried))
        waited = time.perf_counter() - queued_at
        self._metrics.queue_wait.labels(pool.name, call.decision.job).observe(waited)
        call.queue_wait += waited
        call.attempts += 1
        tried.add(backend.name)
        call.backend = backend
        if call.payload.get("stream") is True:
            backend.await_first_token(id(call), time.monotonic())  # shows in the live view while it waits
        call.concurrency = backend.concurrency(time.monotonic(), self._settings.scrape.stale_after)
        self._retrying += retry
        try:
            may_retry = not last and self._retry_allowed() and self._next_pool(call, frozenset(tried)) is not None
            await self._forward(send, call, backend, body, drop_usage_chunk, may_retry=may_retry)
        finally:
            self._retrying -= retry
            backend.forget_first_token(id(call))
            pool.release(backend, duration=time.perf_counter() - call.started)

    async def _forward(
        self, send: Send, call: Call, backend: Backend, body: bytes, drop_usage_chunk: bool, *, may_retry: bool
    ) -> None:
        headers = request_headers(
            call.headers,
            drop=self._override_headers,
            request_id=call.request_id,
            api_key=backend.api_key,
            forward_authorization=self._settings.forward_client_authorization,
        )
        limits = self._settings.limits
        try:
            response = await self._send(backend, call.target, headers, body)
        except TransportError as exc:
            self._failed(backend, exc, may_retry=may_retry)
        try:
            status = response.status
            call.status = status
            if status in _RETRYABLE_STATUS:
                self._metrics.upstream_errors.labels(backend.pool, backend.name, f"http_{status}").inc()
                backend.request_failed(time.monotonic(), self._settings.health)
                if may_retry:
                    self._metrics.retries.labels(backend.pool, backend.name, f"http_{status}").inc()
                    raise _Retry(UpstreamError(f"backend {backend.name!r} answered {status}"))
            elif status >= 500:
                self._metrics.upstream_errors.labels(backend.pool, backend.name, "http_5xx").inc()
            else:
                backend.request_succeeded()
            content_type = response.header(b"content-type") or b""
            if call.payload.get("stream") is True and content_type.startswith(b"text/event-stream"):
                await self._relay_stream(send, response, drop_usage_chunk, call)
                return
            try:
                content = await response.read(limit=limits.response_body_bytes)  # nothing has gone to the client yet
            except TransportError as exc:
                self._failed(backend, exc, may_retry=may_retry)
            await self._relay_whole(send, response, content, content_type, call)
        finally:
            await response.aclose()

    async def _send(self, backend: Backend, target: str, headers: list[tuple[str, str]], body: bytes) -> Response:
        """The request to `backend`, until its response head. One the transport could not write at
        all (NotSent: the engine had closed the pooled connection first) goes to the same backend
        again at once, pinned or not and outside the retry budget: the engine never saw it. Each
        is counted in `specroute_retries_total` (reason `not_sent`)."""
        timeouts, limits = self._settings.timeouts, self._settings.limits
        resends = 0
        while True:
            try:
                return await self._transport.request(
                    backend.url,
                    target,
                    headers=headers,
                    body=body,
                    timeouts=Timeouts(connect=timeouts.connect, read=timeouts.read, idle=timeouts.idle),
                    limits=HeadLimits(head_bytes=limits.response_head_bytes, headers=limits.response_headers),
                )
            except NotSent:
                if resends == _NOT_SENT_RESENDS:
                    raise
                resends += 1
                self._metrics.retries.labels(backend.pool, backend.name, "not_sent").inc()

    def _upstream_body(self, call: Call) -> tuple[bytes, bool]:
        """The body to send upstream, and whether the usage chunk of its stream is ours to drop."""
        payload = call.payload
        if payload.get("stream") is True and call.path in _USAGE_PATHS:
            options = payload.get("stream_options")
            options = options if isinstance(options, dict) else {}
            if options.get("include_usage") is not True:
                # Ask for the token counts; the client did not, so the extra chunk is removed.
                payload["stream_options"] = {**options, "include_usage": True}
                return json.dumps(payload, separators=(",", ":")).encode(), True
        return call.body or json.dumps(payload, separators=(",", ":")).encode(), False

    def _failed(self, backend: Backend, exc: TransportError, *, may_retry: bool) -> NoReturn:
        """A failure before any byte reached the client: retry it if allowed, else report it."""
        error, kind = self._upstream_failure(backend, exc)
        backend.request_failed(time.monotonic(), self._settings.health)
        if may_retry and not isinstance(exc, TooLarge):  # another engine would not be asked less
            self._metrics.retries.labels(backend.pool, backend.name, kind).inc()
            raise _Retry(error) from exc
        raise error from exc

    def _retry_allowed(self) -> bool:
        """The retry budget: a share of the requests in flight, and always a few."""
        config = self._settings.retries
        in_flight = sum(pool.in_flight for pool in self._pools)
        return self._retrying < max(config.min_concurrent, config.budget * in_flight)

    def _next_pool(self, call: Call, tried: frozenset[str]) -> str | None:
        """Where a retry would go: another backend of the same pool, else another pool."""
        assert call.decision is not None
        pool = self._pools.get(call.decision.pool)
        if pool is not None and pool.has_other(tried):
            return call.decision.pool
        if not self._settings.retries.cross_pool or call.decision.reason == "pinned":
            return None
        return next((pool.name for pool in self._pools if pool.has_other(tried)), None)

    def _reroute(self, call: Call, tried: frozenset[str]) -> None:
        assert call.decision is not None
        target = self._next_pool(call, tried)
        if target is not None and target != call.decision.pool:
            call.decision = replace(call.decision, pool=target, reason=f"failover:{call.decision.pool}")

    async def _relay_whole(
        self, send: Send, response: Response, content: bytes, content_type: bytes, call: Call
    ) -> None:
        if response.status < 400 and content_type.startswith(b"application/json"):
            try:
                usage = json.loads(content).get("usage")
            except (ValueError, AttributeError, RecursionError):
                usage = None
            call.tokens = sse.completion_tokens(usage)
            call.prompt_tokens = sse.prompt_tokens(usage)
        headers = response_headers(response.headers, self._route_headers(call))
        headers.append((b"content-length", str(len(content)).encode()))
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        await send({"type": "http.response.body", "body": content})

    async def _relay_stream(self, send: Send, response: Response, drop_usage_chunk: bool, call: Call) -> None:
        watch = sse.StreamWatch(drop_usage_chunk=drop_usage_chunk, max_event=self._settings.limits.sse_event_bytes)
        headers = response_headers(response.headers, self._route_headers(call))
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        call.streaming = True
        # From here on a byte has gone to the client: nothing may be retried, failures end the
        # stream with an error event.
        try:
            async for chunk in response.iter_raw():
                out = watch.feed(chunk)
                if watch.saw_content and call.ttft is None:
                    self._first_token(call)
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
            tail = watch.flush()
        except (TransportError, sse.EventTooLarge) as exc:
            assert call.backend is not None
            failure = exc if isinstance(exc, TransportError) else TooLarge(str(exc))
            error, _ = self._upstream_failure(call.backend, failure)
            call.backend.request_failed(time.monotonic(), self._settings.health)
            call.status, call.code = error.status_code, error.code
            tail = error.event()
        call.tokens = watch.completion_tokens
        call.prompt_tokens = sse.prompt_tokens(watch.usage)
        await send({"type": "http.response.body", "body": tail, "more_body": False})

    def _first_token(self, call: Call) -> None:
        # Recorded when it arrives, not when the request ends: a queue shows while it builds.
        assert call.backend is not None and call.decision is not None
        call.ttft = time.perf_counter() - call.started
        model = self._metrics.model(_field(call.payload, "model", str))
        labels = (call.decision.pool, call.backend.name, call.decision.job, model)
        self._metrics.ttft.labels(*labels).observe(call.ttft)
        call.backend.first_token(id(call), call.ttft)

    def _upstream_failure(self, backend: Backend, exc: TransportError) -> tuple[UpstreamError, str]:
        """The one place where the transport's exceptions become the router's: (error, kind)."""
        error: UpstreamError
        if isinstance(exc, TlsError):
            kind = "tls"
            error = UpstreamError(f"backend {backend.name!r}: {exc}", code="upstream_tls")
            logger.warning("backend %r: %s", backend.name, exc)
        elif isinstance(exc, ConnectError):
            kind = "connect"
            error = UpstreamError(f"backend {backend.name!r} is unreachable", code="upstream_unreachable")
        elif isinstance(exc, ReadTimeout):
            kind = "timeout"
            error = UpstreamTimeout(f"backend {backend.name!r} timed out", code="upstream_timeout")
        elif isinstance(exc, WrongAnswer):
            kind = "wrong_answer"
            error = UpstreamError(f"backend {backend.name!r} answered another request", code="upstream_failed")
            logger.warning("backend %r: %s; the connection is closed", backend.name, exc)
        else:
            kind = "protocol"
            # The limit broken is ours to name; aiohttp's own messages may quote the engine's bytes.
            reason = str(exc) if isinstance(exc, TooLarge) else type(exc).__name__
            error = UpstreamError(f"backend {backend.name!r} failed: {reason}", code="upstream_failed")
        self._metrics.upstream_errors.labels(backend.pool, backend.name, kind).inc()
        return error, kind

    def _learn(self, backend: Backend, call: Call, speed: float) -> None:
        assert call.decision is not None
        self._speeds.observe(
            backend.name,
            call.decision.content,
            concurrency=call.concurrency,
            speed=speed,
            tokens=call.tokens or 0,
            gain=backend.accept_length(time.monotonic(), self._settings.scrape.acceptance_max_age),
        )

    def _route_headers(self, call: Call) -> dict[str, str]:
        headers = {"x-request-id": call.request_id}
        if call.decision is not None:
            headers["x-route-pool"] = call.decision.pool
            headers["x-job-type"] = call.decision.job
            headers["x-route-reason"] = call.decision.reason
        if call.backend is not None:
            headers["x-route-backend"] = call.backend.name
        return headers

    def _finish(self, call: Call) -> None:
        duration = time.perf_counter() - call.started
        decision, backend = call.decision, call.backend
        pool = decision.pool if decision else ""
        name = backend.name if backend else ""
        job = decision.job if decision else ""
        model = self._metrics.model(_field(call.payload, "model", str))
        labels = (pool, name, job, model)
        self._metrics.requests.labels(*labels, str(call.status), call.code or "").inc()
        self._metrics.duration.labels(*labels).observe(duration)
        if backend is not None:
            if call.tokens:
                self._metrics.completion_tokens.labels(pool, name, model).inc(call.tokens)
                if call.ttft is not None and call.tokens > 1 and call.status < 400:
                    elapsed = time.perf_counter() - call.started - call.ttft
                    self._metrics.tpot.labels(*labels).observe(elapsed / (call.tokens - 1))
                    self._learn(backend, call, (call.tokens - 1) / elapsed)
            if call.prompt_tokens:
                self._metrics.prompt_tokens.labels(pool, name, model).inc(call.prompt_tokens)
        if access_log.isEnabledFor(logging.INFO):
            fields = _access_fields(call, duration)
            access_log.info(logs.key_values(fields), extra={"fields": fields})


def _access_fields(call: Call, duration: float) -> dict[str, str | int | None]:
    """What the access log says of a request: never a prompt, a completion or a key."""
    decision = call.decision
    return {
        "id": call.request_id,
        "path": call.path,
        "model": _field(call.payload, "model", str),
        "client": logs.client_hash(call.client) if call.client else None,
        "job": decision.job if decision else None,
        "reason": decision.reason if decision else None,
        "pool": decision.pool if decision else None,
        "backend": call.backend.name if call.backend else None,
        "status": call.status,
        "code": call.code,
        "retries": max(call.attempts - 1, 0),
        "queue_ms": round(call.queue_wait * 1000),
        "ttft_ms": round(call.ttft * 1000) if call.ttft is not None else None,
        "tokens": call.tokens,
        "duration_ms": round(duration * 1000),
    }


def _raw_target(scope: Scope) -> str:
    # llhttp admits only printable ASCII in a request target, so latin-1 keeps every byte as it is.
    raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
    query: bytes = scope["query_string"]
    return (raw_path + (b"?" + query if query else b"")).decode("latin-1")


def _check_path(path: str) -> None:
    """Refuse a path that means something else once decoded: a dot segment (`%2e%2e`), which
    may climb out of /v1/ at the engine or a proxy in between, or a control character (`%00`).
    Anything else is forwarded raw, percent-encoding and all (`%2F`, `%20`, `%3F`)."""
    if _CONTROL.search(path) or any(segment in (".", "..") for segment in path.split("/")):
        raise BadRequest("the request path has a dot segment or a control character", code="invalid_path")


def _field(payload: dict[str, Any], key: str, kind: type[T]) -> T | None:
    value = payload.get(key)
    # bool is an int to Python, but `"n": true` is not a count.
    return value if isinstance(value, kind) and not isinstance(value, bool) else None


async def _send_response(send: Send, response: Any) -> None:
    await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})
