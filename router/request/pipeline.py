"""The request path, top to bottom: one request through the stages, each handing on a frozen value.

    ingress  (request.ingress)    who, may they, the body            -> Incoming
    decide   (request.decide)     classification, content, snapshot  -> Routed: where and why
             (request.place)      its conversation's cached prefix   -> Routed with a backend to prefer
    owners   (responses.stage)    a stored response it names, if any -> Routed pinned to its backend
    forward  (request.forward)    the attempt loop, slots, retries   -> Answer | Failure
    relay    (request.relay)      whole or as a stream               -> Outcome
             (responses.stage)    a stored response made or deleted: noted
    observe  (request.observe)    metrics, learning, the access log  <- Finished

The request takes the settings once, as the `Plan` of the moment, and keeps it to its end.
It is a plain ASGI app rather than a Starlette endpoint so that the bytes of a stream go from the
upstream socket to the client socket with nothing in between but one `StreamWatch.feed`, and so
that a client's disconnect cancels everything under way at once (queue wait, upstream request).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from starlette.types import Message, Receive, Scope, Send

from router.backends.pools import Pools
from router.clock import Clock
from router.errors import RouterError, ShuttingDown
from router.replicas.shared import Replicas
from router.replies import error_response
from router.request import ingress
from router.request.decide import Routed, decide
from router.request.forward import Answer, Attempts, Forwarder
from router.request.incoming import Arrival, Incoming
from router.request.observe import Finished, Observer
from router.request.payload import ClientGone
from router.request.place import Placement, conversation, with_conversation
from router.request.plan import Plan
from router.request.relay import Outcome, Progress, relay_stream, relay_whole
from router.responses.stage import StoredResponses
from router.routing.clients import Clients
from router.routing.conversations import ConversationIndex
from router.routing.learn import SpeedModel
from router.routing.limits import Admitted, Limiter
from router.routing.policy import Decision
from router.routing.snapshot import snapshot
from router.server.uvicorn_private import CLIENT_STREAM, ClientStream
from router.tracing import RequestSpan, Tracer
from router.transport import TransportError

# An ASGI extension: a caller that asks for it hears `{"type": ADMITTED}` when its request enters a
# pool (holds a slot or waits in the pool's queue); the batch runner counts its lines by it.
ADMITTED = "specroute.admitted"


class Pipeline:
    def __init__(
        self,
        *,
        pools: Pools,
        clients: Clients,
        replicas: Replicas,
        speeds: SpeedModel,
        forwarder: Forwarder,
        observer: Observer,
        owners: StoredResponses,
        conversations: ConversationIndex,
        limiter: Limiter,
        clock: Clock,
        tracer: Tracer | None = None,
    ) -> None:
        """`tracer`: a span per request (router.tracing), or None: tracing off."""
        self._pools = pools
        self._placement = Placement(conversations, pools, observer, clock)
        self._clients = clients
        self._replicas = replicas
        self._speeds = speeds
        self._forwarder = forwarder
        self._observer = observer
        self._owners = owners
        self._limiter = limiter
        self._clock = clock
        self._tracer = tracer
        self.plan: Plan | None = None  # set by Router.apply, swapped whole on a reload
        self._serving: set[_Serving] = set()  # one per request being served

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        plan = self.plan  # once: a reload meanwhile does not reach this request
        assert plan is not None, "Router.apply sets the plan before the app serves"
        arrival = ingress.arrive(scope, self._clock.now())
        incoming: Incoming | None = None
        request = _Record(scope.get("extensions", {}).get(CLIENT_STREAM))
        if self._tracer is not None:
            request.span = self._tracer.start(arrival, self._clock.now() - arrival.started)
        try:
            # Ingress: the client's key, the body within its limits, the JSON.
            incoming = await ingress.accept(arrival, scope, receive, plan)
            # A proxy the router does not trust makes its users one client: said once per proxy.
            self._clients.proxies.check(ingress.peer(scope), incoming.headers.get("x-forwarded-for"))
            # Limits: within its key's (or group's) rates and requests in flight, or 429.
            if not incoming.internal:
                request.limits = self._limiter.admit(
                    client=incoming.client,
                    key=incoming.api_key,
                    group=incoming.group,
                    prompt_tokens=incoming.prompt.tokens,
                    now=self._clock.now(),
                )
            new_client = self._clients.start(incoming.client)
            try:
                # Decision: a new client's first burst shows itself first (on the other replicas
                # too, asked before and after it); then where and why.
                if new_client:
                    await self._replicas.arrived(incoming.client)
                if await self._clients.settle(incoming.client, new=new_client):
                    await self._replicas.arrived(incoming.client)  # the burst as it is now
                now = self._clock.now()
                prompt, cached = self._placement.look_up(incoming, plan, now)  # its conversation, if placed
                pools = snapshot(
                    self._pools,
                    self._speeds,
                    now=now,
                    stale_after=plan.stale_after,
                    kv_threshold=plan.routing.kv_threshold,
                    acceptance_max_age=plan.acceptance_max_age,
                    tokens=incoming.prompt.total,
                    cached=cached,
                    load_bound=plan.conversations.load_bound,
                    min_gain=plan.conversations.min_gain,
                    prefill_token_seconds=plan.conversations.prefill_token_seconds,
                )
                routed = decide(
                    incoming,
                    classifier=plan.classifier,
                    policy=plan.policy,
                    code_hints=plan.code_hints,
                    client_load=self._clients.load(incoming.client) - 1,  # the others, not this one
                    pools=pools,
                    ttft=plan.ttft,
                )
                if prompt is not None and cached is not None:
                    routed = with_conversation(routed, pools, prompt, cached)
                routed = await self._owners.route(incoming, routed, plan)  # a stored response: to its backend
                if request.span is not None:  # the engine's spans join the request's trace
                    routed = replace(routed, trace=tuple(request.span.upstream_headers()))
                self._observer.decided(routed.decision)
                request.decision = routed.decision
                if ADMITTED in scope.get("extensions", {}):  # an in-process caller counting its requests
                    await send({"type": ADMITTED})  # entering a pool now: nothing awaits before it
                # Forwarding and relay, cancelled at once if the client leaves.
                await self._serve_until_disconnect(receive, send, incoming, routed, plan, request)
            finally:
                self._clients.finish(incoming.client)
                self._replicas.left(incoming.client)
        except ClientGone:
            request.status = 499
        except RouterError as exc:
            request.status, request.code = exc.status_code, exc.code
            await _send_error(send, exc, _route_headers(arrival, request))
        except Exception:
            # A bug: answered in OpenAI's shape if nothing has gone to the client yet, logged and
            # the connection closed by uvicorn (the request is served past Starlette's own guard).
            error = RouterError("the router failed to serve the request", code="internal_error")
            request.status, request.code = error.status_code, error.code
            if not request.progress.streaming:
                await _send_error(send, error, _route_headers(arrival, request))
            raise
        finally:
            # Observation: whatever became of it; its tokens counted against its limits.
            if request.limits is not None:
                outcome = request.outcome
                self._limiter.finish(
                    request.limits,
                    prompt_tokens=outcome.prompt_tokens if outcome is not None else None,
                    answer_tokens=outcome.tokens if outcome is not None else None,
                    now=self._clock.now(),
                )
            finished = self._finished(arrival, incoming, request, plan)
            self._observer.finished(finished)
            if request.span is not None:
                request.span.end(finished)

    async def _serve_until_disconnect(
        self, receive: Receive, send: Send, incoming: Incoming, routed: Routed, plan: Plan, request: _Record
    ) -> None:
        """Serve the request, cancelling everything (queue wait, upstream) if the client leaves.

        The client's connection (its listener's callback; for an in-process caller a plain task
        waiting on `receive`) cancels the serving task, which is this one, when the client leaves:
        no task group or cancel scope per request, and no task where the router's listener serves it."""
        task = asyncio.current_task()
        assert task is not None
        serving = _Serving(task)
        client = request.client
        waiter: asyncio.Future[None] | None = None
        if client is None or not client.watch(serving.client_gone):  # the listener's own: no task
            waiter = asyncio.ensure_future(_disconnected(receive))
            waiter.add_done_callback(serving.client_left)

        async def send_while_there(message: Message) -> None:
            if serving.gone:
                # The cancel has landed and something under way swallowed it (a task's cancel is
                # delivered once, where anyio's scope cancelled every await after it): uvicorn
                # drops what is sent to a client that left, so the relay would run to its end.
                raise ClientGone
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                # The answer is complete, and uvicorn's `receive` says "disconnect" from now on:
                # closing the upstream response after it is not the client leaving.
                serving.active = False

        self._serving.add(serving)
        try:
            await self._serve(send_while_there, incoming, routed, plan, request)
        except asyncio.CancelledError:
            if not serving.cancelled or task.uncancel() > 0:
                raise  # cancelled from outside as well: not ours to end here
            if serving.gone:
                raise ClientGone from None
            await self._end_for_shutdown(send, request)  # ended by `end_all`
        finally:
            serving.active = False  # a disconnect from now on cancels nothing
            self._serving.discard(serving)
            if waiter is not None:
                waiter.cancel()
            elif client is not None:
                client.unwatch(serving.client_gone)

    async def _serve(self, send: Send, incoming: Incoming, routed: Routed, plan: Plan, request: _Record) -> None:
        result = await self._forwarder.forward(incoming, routed, plan, request.noted)
        if not isinstance(result, Answer):
            request.noted(result.attempts)
            raise result.error
        if routed.prompt is not None:
            self._placement.placed(routed, result.backend)
        try:
            headers = _route_headers(incoming.arrival, request)
            if result.content is not None:
                request.outcome = await relay_whole(send, result.response, result.content, headers, request.progress)
            else:
                request.outcome = await self._relay_stream(send, incoming, routed, plan, result, request, headers)
            self._owners.note(incoming, result, request.outcome)
        finally:
            await result.response.aclose()
            self._forwarder.release(incoming, result)

    async def _relay_stream(
        self,
        send: Send,
        incoming: Incoming,
        routed: Routed,
        plan: Plan,
        answer: Answer,
        request: _Record,
        headers: dict[str, str],
    ) -> Outcome:
        backend, decision = answer.backend, answer.attempts.decision
        model = incoming.field("model", str)

        def first_token() -> float:
            # Recorded when it arrives, not when the request ends: a queue shows while it builds.
            ttft = self._clock.now() - incoming.arrival.started
            self._observer.first_token(decision, backend, model, ttft, id(incoming), target=plan.routing.ttft_target)
            return ttft

        def broken(exc: TransportError) -> tuple[int, str | None, bytes]:
            error, _ = self._forwarder.upstream_failure(backend, exc)
            backend.outlier.request_failed(self._clock.now())
            return error.status_code, error.code, error.event()

        return await relay_stream(
            send,
            answer.response,
            headers,
            request.progress,
            drop_usage_chunk=routed.drop_usage_chunk,
            max_event=plan.sse_event_bytes,
            first_token=first_token,
            broken=broken,
            client=request.client,
        )

    def end_all(self) -> None:
        """End every request being served: at the end of a shutdown's grace period."""
        for serving in self._serving:
            serving.end()

    async def _end_for_shutdown(self, send: Send, request: _Record) -> None:
        error = ShuttingDown("the router is shutting down; send the request again", code="shutting_down")
        request.status, request.code = error.status_code, error.code
        if not request.progress.streaming:
            raise error  # nothing has gone to the client yet
        # Like a stream whose upstream failed: the events so far, one error event, no [DONE].
        await send({"type": "http.response.body", "body": error.event(), "more_body": False})

    def _finished(self, arrival: Arrival, incoming: Incoming | None, request: _Record, plan: Plan) -> Finished:
        now = self._clock.now()
        attempts, outcome = request.attempts, request.outcome
        backend = attempts.backend if attempts is not None else None
        status, code = request.status, request.code
        if outcome is not None and not status:
            status, code = outcome.status, outcome.code
        return Finished(
            arrival=arrival,
            duration=now - arrival.started,
            status=status,
            code=code,
            model=incoming.field("model", str) if incoming is not None else None,
            client=incoming.client if incoming is not None else None,
            decision=request.decision,
            backend=backend,
            attempts=attempts.count if attempts is not None else 0,
            queue_wait=attempts.queue_wait if attempts is not None else 0.0,
            concurrency=attempts.concurrency if attempts is not None else 0,
            ttft=request.progress.ttft,
            tokens=outcome.tokens if outcome is not None else None,
            prompt_tokens=outcome.prompt_tokens if outcome is not None else None,
            accept_length=backend.engine.accept_length(now, plan.acceptance_max_age) if backend is not None else None,
            conversation=conversation(incoming, plan.conversations.session_header) if incoming is not None else None,
            declared=incoming is not None and plan.job_header in incoming.arrival.headers,
            streamed=incoming.stream if incoming is not None else False,
        )


class _Serving:
    """One request's serving task, while it serves: what may end it, and whether something did."""

    __slots__ = ("active", "cancelled", "client_gone", "gone", "task")

    def __init__(self, task: asyncio.Task[object]) -> None:
        self.task = task
        self.client_gone = self._client_gone  # one bound method: the listener given and taken back
        self.active = True
        self.cancelled = False  # by the client leaving or by `end_all`
        self.gone = False  # the client left

    def client_left(self, waiter: asyncio.Future[None]) -> None:
        if not waiter.cancelled() and waiter.exception() is None:
            self._client_gone()

    def _client_gone(self) -> None:
        if self.active:
            self.gone = True
            self._cancel()

    def end(self) -> None:
        if self.active:
            self._cancel()

    def _cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self.task.cancel()


async def _disconnected(receive: Receive) -> None:
    """Returns once the client has left: after the body, uvicorn's `receive` has nothing else to say."""
    while (await receive())["type"] != "http.disconnect":
        pass


class _Record:
    """What became of one request so far: filled in as it goes, read once at its end."""

    __slots__ = ("attempts", "client", "code", "decision", "limits", "outcome", "progress", "span", "status")

    def __init__(self, client: ClientStream | None) -> None:
        self.client = client  # the client's connection, where the router's own listener serves it
        self.span: RequestSpan | None = None
        self.decision: Decision | None = None
        self.attempts: Attempts | None = None
        self.outcome: Outcome | None = None
        self.progress = Progress()
        self.status = 0  # set when the router answered or ended the request itself
        self.code: str | None = None
        self.limits: Admitted | None = None  # within the limits of its key or group, if any apply

    def noted(self, attempts: Attempts) -> None:
        self.attempts = attempts
        self.decision = attempts.decision  # `failover:<pool>` once it moved


def _route_headers(arrival: Arrival, request: _Record) -> dict[str, str]:
    headers = {"x-request-id": arrival.request_id}
    if request.limits is not None:
        headers.update(request.limits.headers)  # OpenAI's x-ratelimit-*: where its limits stood
    if request.decision is not None:
        headers["x-route-pool"] = request.decision.pool
        headers["x-job-type"] = request.decision.job
        headers["x-route-reason"] = request.decision.reason
        if request.decision.predictions:
            headers["x-route-predicted-ttft"] = ", ".join(f"{p}={s:.3f}" for p, s in request.decision.predictions)
    if request.attempts is not None and request.attempts.backend is not None:
        headers["x-route-backend"] = request.attempts.backend.name
    return headers


async def _send_error(send: Send, error: RouterError, headers: dict[str, str]) -> None:
    response = error_response(error, headers)
    await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})
