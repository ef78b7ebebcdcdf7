"""StreamWatch: bytes pass through unchanged however the upstream splits them."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.sse import EventTooLarge, StreamWatch


def _event(payload: dict[str, object]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


ROLE = _event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
CONTENT = [_event({"choices": [{"index": 0, "delta": {"content": f"tok{i} "}}]}) for i in range(5)]
FINISH = _event({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
USAGE = _event({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}})
DONE = b"data: [DONE]\n\n"
STREAM = ROLE + b"".join(CONTENT) + FINISH + USAGE + DONE


def _replay(watch: StreamWatch, data: bytes, cuts: list[int]) -> tuple[bytes, int | None]:
    """Feed `data` cut at `cuts`; return what came out and how many bytes in the first content was seen."""
    out = b""
    first_at = None
    bounds = [0, *sorted(set(cuts)), len(data)]
    for start, end in itertools.pairwise(bounds):
        out += watch.feed(data[start:end])
        if watch.saw_content and first_at is None:
            first_at = end
    return out + watch.flush(), first_at


@given(st.lists(st.integers(min_value=1, max_value=len(STREAM) - 1), max_size=40))
def test_any_split_reaches_client_byte_identical(cuts: list[int]) -> None:
    watch = StreamWatch(drop_usage_chunk=False)
    out, first_at = _replay(watch, STREAM, cuts)
    assert out == STREAM
    assert watch.completion_tokens == 5
    # Content is noticed no earlier than the first content event is complete.
    assert first_at is not None
    assert first_at >= len(ROLE) + len(CONTENT[0])


@given(st.lists(st.integers(min_value=1, max_value=len(STREAM) - 1), max_size=40))
def test_router_requested_usage_chunk_is_removed_and_counted(cuts: list[int]) -> None:
    watch = StreamWatch(drop_usage_chunk=True)
    out, _ = _replay(watch, STREAM, cuts)
    assert out == STREAM.replace(USAGE, b"")
    assert watch.completion_tokens == 5


def test_role_only_chunk_is_not_content() -> None:
    watch = StreamWatch(drop_usage_chunk=False)
    assert watch.feed(ROLE) == ROLE
    assert not watch.saw_content
    watch.feed(CONTENT[0])
    assert watch.saw_content


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content", "tool_calls"])
def test_reasoning_and_tool_calls_are_the_first_token(field: str) -> None:
    """A reasoning model's first token is its reasoning (vLLM 0.32 names it `reasoning`, earlier
    vLLM and SGLang `reasoning_content`); a tool call's is its first piece."""
    value: object = [{"index": 0, "id": "call_1", "type": "function"}] if field == "tool_calls" else "Hm"
    event = b"data: " + json.dumps({"choices": [{"index": 0, "delta": {field: value}}]}).encode() + b"\n\n"
    watch = StreamWatch(drop_usage_chunk=False)
    watch.feed(ROLE)
    watch.feed(event)
    assert watch.saw_content


def test_completions_text_and_crlf_events() -> None:
    watch = StreamWatch(drop_usage_chunk=False)
    event = b'data: {"choices": [{"index": 0, "text": "hi"}]}\r\n\r\n'
    assert watch.feed(event[:10]) == b""
    assert watch.feed(event[10:]) == event
    assert watch.saw_content


def test_empty_text_and_comments_are_not_content() -> None:
    watch = StreamWatch(drop_usage_chunk=False)
    data = b": keep-alive\n\n" + b'data: {"choices": [{"index": 0, "text": ""}]}\n\n'
    assert watch.feed(data) == data
    assert not watch.saw_content


def test_responses_api_events() -> None:
    watch = StreamWatch(drop_usage_chunk=False)
    delta = b'event: response.output_text.delta\ndata: {"type": "response.output_text.delta", "delta": "Hi"}\n\n'
    done = b'data: {"type": "response.completed", "response": {"usage": {"input_tokens": 3, "output_tokens": 9}}}\n\n'
    assert watch.feed(delta + done) == delta + done
    assert watch.saw_content
    assert watch.completion_tokens == 9


def test_unterminated_tail_is_flushed_as_is() -> None:
    watch = StreamWatch(drop_usage_chunk=False)
    assert watch.feed(CONTENT[0] + b"data: partial") == CONTENT[0]
    assert watch.flush() == b"data: partial"


def test_error_event_after_content_is_noticed_and_passed_on() -> None:
    watch = StreamWatch(drop_usage_chunk=False)
    error = b'data: {"error": {"message": "engine died", "type": "upstream_error"}}\n\n'
    assert watch.feed(CONTENT[0] + CONTENT[1]) == CONTENT[0] + CONTENT[1]
    assert watch.feed(error) == error
    assert watch.error == "engine died"


CRLF_STREAM = STREAM.replace(b"\n\n", b"\r\n\r\n")


@given(st.lists(st.integers(min_value=1, max_value=len(CRLF_STREAM) - 1), max_size=40))
def test_crlf_events_split_anywhere_reach_client_byte_identical(cuts: list[int]) -> None:
    out, _ = _replay(StreamWatch(drop_usage_chunk=False), CRLF_STREAM, cuts)
    assert out == CRLF_STREAM


def test_an_event_over_the_limit_is_refused_as_it_grows() -> None:
    watch = StreamWatch(drop_usage_chunk=False, max_event=4096)
    assert watch.feed(CONTENT[0]) == CONTENT[0]
    assert watch.feed(b"data: " + b"a" * 4000) == b""
    with pytest.raises(EventTooLarge):
        watch.feed(b"a" * 1000)


def test_an_event_at_the_limit_passes() -> None:
    event = b"data: " + b"a" * 4000 + b"\n\n"
    watch = StreamWatch(drop_usage_chunk=False, max_event=4096)
    assert b"".join(watch.feed(event[i : i + 100]) for i in range(0, len(event), 100)) == event
