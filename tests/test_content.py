"""Prose or code, from the request body: what is read, and what it decides."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.content import (
    ContentKind,
    PromptText,
    detect_kind,
    read_prompt,
    request_text,
)
from router.prompts import prompts


@pytest.mark.parametrize(
    ("payload", "text"),
    [
        ({"messages": [{"role": "user", "content": "hello"}]}, "hello"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}]}]}, "a"),
        ({"prompt": "p"}, "p"),
        ({"prompt": ["p", 3, "q"]}, "p\nq"),
        ({"input": "r"}, "r"),
        ({"input": [{"role": "user", "content": "s"}]}, "s"),
        # What a client may send that is no prompt at all: read as nothing, never an error.
        ({"messages": 1}, ""),
        ({"messages": "hello"}, ""),
        ({"messages": [1, None, {"content": 5}]}, ""),
        ({"prompt": {"a": 1}}, ""),
        ({}, ""),
    ],
)
def test_request_text_reads_the_prompt_and_ignores_what_is_not_one(payload: dict[str, Any], text: str) -> None:
    assert request_text(payload) == text


@pytest.mark.parametrize(
    ("text", "hints", "kind"),
    [
        ("Tell me about the tides of the North Sea.", (), "prose"),
        ("```python\nprint(1)\n```", (), "code"),
        ("def area(r):\n    return 3.14 * r * r", (), "code"),
        ("Please refactor this function in python", (), "code"),
        ("Summarise the quarterly report", ("quarterly",), "code"),
    ],
)
def test_detect_kind(text: str, hints: tuple[str, ...], kind: ContentKind) -> None:
    assert detect_kind(text, hints=hints) == kind


# The same patterns on Python's backtracking engine, as an oracle: on short text (where
# backtracking costs little) RE2 must decide exactly as they do.
_OLD_MARKERS = re.compile(
    r"```|^\s*(def|class|import|from|fn|func|function|const|let|var|public|private|#include|package|SELECT|"
    r"return)\b|[{};]\s*$|=>|->|::|\w+\([^)]*\)\s*[:{]",
    re.MULTILINE,
)
_OLD_WORDS = re.compile(
    r"\b(function|python|javascript|typescript|rust|golang|java|sql|regex|refactor|compile|bug|stack trace|"
    r"unit test|implement|code)\b",
    re.IGNORECASE,
)


def _old_kind(text: str) -> ContentKind:
    return "code" if _OLD_MARKERS.search(text) or len(_OLD_WORDS.findall(text)) >= 2 else "prose"


@pytest.mark.parametrize("kind", ["prose", "code"])
def test_the_shipped_prompts_are_classified_as_before(kind: ContentKind) -> None:
    for prompt in prompts(kind):
        assert detect_kind(prompt) == _old_kind(prompt) == kind


# ASCII text built from the pieces the patterns look for (RE2's \w and \b are ASCII-only).
_PIECES = st.sampled_from(
    ["def ", "class ", "return", "f(x)", " {", "}", ";", ":", "=>", "->", "::", "```", "(", ")", "\n", "\t", " ",
     "python", "code", "bug", "a", "word", "_", "9", ".", "SELECT", "#include", "unit test", "Code"]
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.lists(_PIECES, max_size=40).map("".join))
def test_re2_decides_exactly_as_the_old_patterns_did(text: str) -> None:
    assert detect_kind(text) == _old_kind(text)


def test_only_a_prefix_and_a_suffix_are_read() -> None:
    filler = "Tell me about the tides. " * 2000  # 50,000 characters of prose
    assert detect_kind(filler + "def area(r):\n    return r") == "code"  # the question at the end
    assert detect_kind("def area(r):\n    return r\n" + filler) == "code"  # the code at the start
    assert detect_kind(filler[:25_000] + "def area(r):\n" + filler[:25_000]) == "prose"  # unread middle


def _cost(text: str) -> float:
    """The least of several timings of one detection: the machine's noise only ever adds."""
    timings = []
    for _ in range(7):
        started = time.perf_counter()
        detect_kind(text)
        timings.append(time.perf_counter() - started)
    return min(timings)


# What made Python's engine backtrack: long runs that a pattern starts on at every position.
_ADVERSARIAL = st.sampled_from(["a", "a(", "\n", "\n\t", " ", ";", "a(b", "(", "a)(", "ab ", "{ ", "x=>"])


@settings(max_examples=25, deadline=None)
@given(unit=_ADVERSARIAL, tail=st.sampled_from(["", "(", ")", " {", "x"]))
def test_detection_time_grows_linearly_with_the_text(unit: str, tail: str) -> None:
    # Both sizes fit within the prefix and suffix that are read, so all of each text is scanned.
    small = (unit * 2000)[:2000] + tail
    large = (unit * 8000)[:8000] + tail
    # Four times the text: linear costs about 4x, the old quadratic patterns 16x (seconds at
    # this size). 10x plus a millisecond of slack leaves room for a busy machine.
    assert _cost(large) < 10 * _cost(small) + 0.001


@pytest.mark.parametrize(
    ("payload", "tokens"),
    [
        ({"messages": [{"role": "user", "content": "x" * 81}], "max_completion_tokens": 256}, 21 + 256),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100, "max_completion_tokens": 50}, 1 + 50),
        ({"prompt": "abcd", "max_tokens": 64, "n": 3}, 1 + 3 * 64),  # n answers, one prompt
        ({"input": "abcdefgh", "max_output_tokens": 10}, 2 + 10),  # the Responses API
        ({"prompt": "abcd"}, None),  # no limit: the engine's own default is not known here
        ({"prompt": "abcd", "max_tokens": True}, None),  # not counts
        ({"prompt": "abcd", "max_tokens": -5, "n": "3"}, None),
        ({"prompt": "abcd", "max_tokens": 8, "n": 0}, 1 + 8),
    ],
)
def test_request_tokens_estimates_a_requests_length_at_its_end(payload: dict[str, Any], tokens: int | None) -> None:
    assert read_prompt(payload).total == tokens


@pytest.mark.parametrize(
    ("payload", "text", "tokens", "total"),
    [
        (
            {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "x" * 81}],
             "max_tokens": 9},
            "be brief\n" + "x" * 81, 23, 23 + 9,
        ),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}]}]}, "a", 1, None),
        ({"prompt": ["abcd", "ef"], "max_tokens": 64, "n": 3}, "abcd\nef", 2, 2 + 3 * 64),
        ({"prompt": [[1, 2, 3], 4], "max_completion_tokens": 5}, "", 4, 5),  # token ids: no text
        ({"input": ["abcdefgh", "ij"], "max_output_tokens": 10}, "", 2 + 1, 10),
        ({"input": [{"role": "user", "content": "hi"}]}, "hi", 1, None),
        ({}, "", 0, None),
    ],
)  # fmt: skip
def test_a_prompt_is_read_once_for_its_text_and_both_estimates(
    payload: dict[str, Any], text: str, tokens: int, total: int | None
) -> None:
    assert read_prompt(payload) == PromptText(text, tokens, total)
