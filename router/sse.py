"""Watching an upstream stream of server-sent events on its way to the client.

The bytes are forwarded as they arrive, cut only at event boundaries, and are looked into
only as far as needed: each event until the first one that carries generated content (that
is the time to first token), then only events that mention `"usage"` (the token counts) or
`"error"`. The benchmark's load generator reads streams with the same watcher.
"""

from __future__ import annotations

import json
import re
from typing import Any

_SEPARATORS = (b"\n\n", b"\r\n\r\n")
_BOUNDARY = re.compile(rb"\r\n\r\n|\n\n")  # the same, either, wherever it comes first
_OVERLAP = 3  # bytes of a separator that may sit at the end of the previous chunk
_MAX_TOKENS = 2**31  # tokens no request reaches


class EventTooLarge(ValueError):
    """An event grew past the size limit before its end arrived."""


class StreamWatch:
    def __init__(self, *, drop_usage_chunk: bool, max_event: int | None = None) -> None:
        # True when the router asked for usage on the client's behalf: the extra chunk is ours.
        self._drop_usage_chunk = drop_usage_chunk
        self._max_event = max_event
        # The start of an event whose end has not come yet, as it arrived: joined once, when it
        # ends, so a long event costs time and memory in proportion to its size.
        self._pending: list[bytes] = []
        self._pending_size = 0
        self.saw_content = False
        self.usage: dict[str, Any] | None = None
        self.error: str | None = None  # the message of an in-stream error event, if one came
        self.response_id: str | None = None  # from the Responses API's `response.created` event

    def feed(self, chunk: bytes) -> bytes:
        """Take bytes from upstream; return the bytes to send on to the client now."""
        if (
            self.saw_content
            and not self._pending
            and chunk.endswith(b"\n\n")
            and b'"usage"' not in chunk  # `_notable`, inlined: this runs once per piece
            and b'"error"' not in chunk
        ):
            return chunk  # the common case once streaming: whole events, nothing to look at
        # A separator may begin in the bytes already held: look at their last few and the new ones.
        overlap = self._pending[-1][-_OVERLAP:] if self._pending else b""
        end = _last_boundary(overlap + chunk) - len(overlap)
        if end <= 0:
            self._pending.append(chunk)
            self._pending_size += len(chunk)
            if self._max_event is not None and self._pending_size > self._max_event:
                raise EventTooLarge(f"a server-sent event is over the {self._max_event} byte limit")
            return b""
        complete = b"".join([*self._pending, chunk[:end]]) if self._pending else chunk[:end]
        rest = chunk[end:]
        self._pending = [rest] if rest else []
        self._pending_size = len(rest)
        if self._max_event is not None and self._pending_size > self._max_event:
            raise EventTooLarge(f"a server-sent event is over the {self._max_event} byte limit")
        if self.saw_content and not _notable(complete):
            return complete
        return self._look_into(complete)

    def _look_into(self, data: bytes) -> bytes:
        """Complete events, each read until the first content and after it only the events that
        mention usage or an error: a read that carries a whole answer (hundreds of events, the
        usage chunk last) is cut at most twice, never split event by event."""
        out = []
        start = 0
        while start < len(data):
            if self.saw_content:
                at = _first_notable(data, start)
                if at < 0:
                    out.append(data[start:])
                    break
                begin = _event_start(data, start, at)
                if begin > start:
                    out.append(data[start:begin])  # passed on as it came
                start = begin
            boundary = _BOUNDARY.search(data, start)
            end = boundary.end() if boundary is not None else len(data)
            out.append(self._inspect(data[start:end]))
            start = end
        return b"".join(out)

    def flush(self) -> bytes:
        """What remains when the upstream ends: an unterminated last event, passed on as is."""
        rest = b"".join(self._pending)
        self._pending, self._pending_size = [], 0
        return self._inspect(rest) if rest else b""

    def _inspect(self, event: bytes) -> bytes:
        if self.saw_content and not _notable(event):
            return event
        payload = _json_payload(event)
        if payload is None:
            return event
        if not self.saw_content:
            # Events before the first content are read anyway: `response.created` is among them.
            self.saw_content = _has_content(payload)
            if payload.get("type") == "response.created" and isinstance(payload.get("response"), dict):
                response_id = payload["response"].get("id")
                self.response_id = response_id if isinstance(response_id, str) else None
        if isinstance(payload.get("error"), dict):
            self.error = str(payload["error"].get("message", "error"))
        usage = payload.get("usage") or _nested_usage(payload)
        if isinstance(usage, dict):
            self.usage = usage
            if self._drop_usage_chunk and payload.get("choices") == []:
                return b""
        return event

    @property
    def completion_tokens(self) -> int | None:
        return completion_tokens(self.usage)


def completion_tokens(usage: dict[str, Any] | None) -> int | None:
    if not usage:
        return None
    return _count(usage.get("completion_tokens", usage.get("output_tokens")))


def prompt_tokens(usage: dict[str, Any] | None) -> int | None:
    if not usage:
        return None
    return _count(usage.get("prompt_tokens", usage.get("input_tokens")))


def _count(value: Any) -> int | None:
    """A token count as an engine can report it; else (negative, a bool, past any model's
    length, a JSON integer no float holds) none: metrics, speeds and limits take no lie."""
    return value if type(value) is int and 0 <= value < _MAX_TOKENS else None


def _notable(data: bytes) -> bool:
    """Whether bytes after the first content may hold something to read: usage or an error."""
    return b'"usage"' in data or b'"error"' in data


def _first_notable(data: bytes, start: int) -> int:
    """Where the first mention of usage or an error is in `data` from `start`; -1: none."""
    found = [at for at in (data.find(b'"usage"', start), data.find(b'"error"', start)) if at >= 0]
    return min(found, default=-1)


def _event_start(data: bytes, start: int, at: int) -> int:
    """The start of the event that holds `data[at]`, the events from `start` being complete."""
    lf, crlf = data.rfind(b"\n\n", start, at), data.rfind(b"\r\n\r\n", start, at)
    return max(start, lf + 2 if lf >= 0 else start, crlf + 4 if crlf >= 0 else start)


def _last_boundary(data: bytes) -> int:
    if data.endswith(b"\n\n"):
        return len(data)  # most reads end with an event: no search through the bytes
    return max((data.rfind(sep) + len(sep) if sep in data else -1) for sep in _SEPARATORS)


def _events(data: bytes) -> list[bytes]:
    """Split complete events, each keeping its own terminator so the bytes rejoin exactly.

    One pass over the bytes: a search for each separator from each event's start would scan to
    the end for the one that is absent, for every event (quadratic in a read of many events).
    """
    events = []
    start = 0
    for boundary in _BOUNDARY.finditer(data):
        events.append(data[start : boundary.end()])
        start = boundary.end()
    if start < len(data):
        events.append(data[start:])
    return events


def _json_payload(event: bytes) -> dict[str, Any] | None:
    lines = [line[5:].lstrip() for line in event.splitlines() if line.startswith(b"data:")]
    if not lines or lines == [b"[DONE]"]:
        return None
    try:
        payload = json.loads(b"\n".join(lines))
    except (ValueError, RecursionError):  # an engine's event nested past the parser's depth too
        return None
    return payload if isinstance(payload, dict) else None


def _has_content(payload: dict[str, Any]) -> bool:
    choices = payload.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            if choice.get("text"):
                return True
            delta = choice.get("delta")
            if isinstance(delta, dict) and (
                delta.get("content")
                or delta.get("reasoning")  # vLLM 0.32's name
                or delta.get("reasoning_content")  # earlier vLLM, SGLang
                or delta.get("tool_calls")
            ):
                return True
        return False
    # The Responses API streams typed events: {"type": "response.output_text.delta", "delta": ...}
    return isinstance(payload.get("delta"), str) and bool(payload["delta"])


def _nested_usage(payload: dict[str, Any]) -> Any:
    response = payload.get("response")
    return response.get("usage") if isinstance(response, dict) else None
