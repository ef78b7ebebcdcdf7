"""Decision, the second stage: where the request goes and why, and what is sent there.

Classification (router.classify) of the request's facts and its client's recent load, the kind
of its content, and the policy (router.policy) over a snapshot of the pools (router.snapshot).
A pure function: no I/O, no clock, no live state but what the caller passes in.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from router.content import ContentKind, detect_kind
from router.errors import BadRequest, NoBackendAvailable
from router.request.incoming import Incoming
from router.routing.classify import Classifier, RequestFacts, UnknownOverride
from router.routing.conversations import Prompt
from router.routing.policy import Decision, Policy, PoolState

# Paths whose streams accept `stream_options.include_usage`.
_USAGE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
_WHITESPACE = b" \t\r\n"  # JSON's, around a value
_EMPTY_OBJECT = re.compile(rb"\{[ \t\r\n]*\}")


@dataclass(frozen=True, slots=True)
class Routed:
    decision: Decision
    body: bytes  # what goes upstream
    drop_usage_chunk: bool  # the stream's usage chunk was asked for by the router, not the client
    backend: str | None = None  # the one backend that may serve it (router.affinity), if any
    prefer: str | None = None  # the backend to take if it has a slot: its prompt's prefix is there
    prompt: Prompt | None = None  # its conversation (router.conversations), noted where it is placed
    held: Mapping[str, int] = field(default_factory=dict)  # prompt tokens each backend likely holds
    trace: tuple[tuple[str, str], ...] = ()  # the request span's context for the engine (router.tracing)


def decide(
    incoming: Incoming,
    *,
    classifier: Classifier,
    policy: Policy,
    code_hints: tuple[str, ...],
    client_load: float,
    pools: Mapping[str, PoolState],
    ttft: TtftTarget | None = None,
) -> Routed:
    """`client_load`: the client's other requests in flight, or its recent peak if higher.
    `ttft`: how a request's own first-token target is read and held (none: not read)."""
    facts = RequestFacts(
        headers=incoming.headers,
        api_key=incoming.api_key,
        model=incoming.field("model", str),
        user=incoming.field("user", str),
        metadata=incoming.field("metadata", dict) or {},
        n=incoming.field("n", int) or 1,
        client_load=client_load,
    )
    try:
        classification = classifier.classify(facts)
    except UnknownOverride as exc:
        raise BadRequest(str(exc), param=exc.header, code=exc.code) from exc
    target = ttft.of(incoming.headers) if ttft is not None else None
    kind = content_kind(incoming.payload, code_hints, text=incoming.prompt.text)
    decision = policy.decide(classification, kind, pools, ttft_target=target)
    if decision.reason == "slo:unmet" and ttft is not None and ttft.reject_unmeetable:
        predicted = ", ".join(f"{name} {state.ttft:.2f} s" for name, state in pools.items() if state.ttft is not None)
        raise NoBackendAvailable(
            f"no pool is predicted to give a first token within {target:g} s ({predicted or 'no prediction'})",
            code="ttft_target_unmeetable",
        )
    body, drop_usage_chunk = upstream_body(incoming, rewrite_model=classification.rewrite_model)
    return Routed(decision, body, drop_usage_chunk)


@dataclass(frozen=True, slots=True)
class TtftTarget:
    """A request's own first-token target (`X-SLO-TTFT-MS`, llm-d's header: milliseconds)."""

    header: str  # lower-cased
    low: float  # seconds: `routing.ttft_target_min`
    high: float  # seconds: `routing.ttft_target_max`
    reject_unmeetable: bool

    def of(self, headers: Mapping[str, str]) -> float | None:
        """The target in seconds, within the bounds; None when absent or not a positive number
        (as llm-d reads it: such a request has no target of its own)."""
        raw = headers.get(self.header)
        if raw is None:
            return None
        try:
            millis = float(raw)
        except ValueError:
            return None
        if not 0 < millis < math.inf:
            return None
        return min(self.high, max(self.low, millis / 1000))


def with_field(body: bytes, key: str, value: Any, *, absent: bool = False) -> bytes:
    """A JSON object body with one top-level field set (replacing the client's own); `absent`:
    the body is known to have no such field, so it is appended to the bytes as they are."""
    if absent and (appended := with_appended(body, {key: value})) is not None:
        return appended
    return json.dumps({**json.loads(body), key: value}, separators=(",", ":")).encode()


def with_appended(body: bytes, fields: Mapping[str, Any]) -> bytes | None:
    """`body`, a JSON object with none of `fields`, with them appended: its bytes copied once,
    not decoded and encoded anew (0.2 ms for a 100 KB prompt). None for an empty object, and for
    bytes that do not open with `{` and end with `}`: JSON in UTF-16 or 32, or after a BOM, parses
    too, and is encoded anew."""
    text = body.rstrip(_WHITESPACE)  # `body` itself when nothing follows its `}`
    if text[:1] != b"{" or text[-1:] != b"}" or _EMPTY_OBJECT.fullmatch(text):  # `{ }`: no field to follow
        return None
    added = json.dumps(fields, separators=(",", ":")).encode()
    return b"".join((memoryview(text)[:-1], b",", added[1:]))


def content_kind(payload: Mapping[str, Any], code_hints: tuple[str, ...], *, text: str) -> ContentKind:
    """`text`: the payload's `request_text`, read once for every stage."""
    if payload.get("tools") or payload.get("functions"):
        return "code"  # tool calls are structured output, which a drafter guesses well
    return detect_kind(text, hints=code_hints)


def upstream_body(incoming: Incoming, *, rewrite_model: str | None) -> tuple[bytes, bool]:
    """The body to send upstream, and whether the usage chunk of its stream is ours to drop.
    The client's bytes go as they came unless something in them must change."""
    changes: dict[str, Any] = {}
    if rewrite_model is not None:
        changes["model"] = rewrite_model
    drop_usage_chunk = False
    if incoming.stream and incoming.arrival.path in _USAGE_PATHS:
        options = incoming.payload.get("stream_options")
        options = options if isinstance(options, dict) else {}
        if options.get("include_usage") is not True:
            # Ask for the token counts; the client did not, so the extra chunk is removed. Usage
            # on every chunk (`continuous_usage_stats`) comes only with `include_usage`: the
            # client, not asking for that, would get none from the engine, so none through here.
            changes["stream_options"] = {**options, "include_usage": True, "continuous_usage_stats": False}
            drop_usage_chunk = True
    if not changes or not incoming.payload:  # nothing to change, or a body not read (an upload): as it came
        return incoming.body, False
    appended = with_appended(incoming.body, changes) if changes.keys().isdisjoint(incoming.payload) else None
    if appended is not None:
        return appended, drop_usage_chunk
    return json.dumps({**incoming.payload, **changes}, separators=(",", ":")).encode(), drop_usage_chunk
