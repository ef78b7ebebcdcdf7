"""Prose or code, from the request body: what is read, and what it decides."""

from __future__ import annotations

from typing import Any

import pytest

from router.content import ContentKind, detect_kind, request_text


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
