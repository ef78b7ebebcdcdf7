"""Cheap detection of what a request is about: prose or code.

Speculative decoding pays off more on code, which a drafter guesses well, than on prose. The
simulator uses this to pick an acceptance rate; the router uses it to decide where the
speculative pool still pays. Only a bounded prefix of the text is looked at.
"""

from __future__ import annotations

import re
from typing import Any, Literal

ContentKind = Literal["prose", "code"]

_SCAN_CHARS = 8192
_CODE_MARKERS = re.compile(
    r"```|^\s*(def|class|import|from|fn|func|function|const|let|var|public|private|#include|package|SELECT|"
    r"return)\b|[{};]\s*$|=>|->|::|\w+\([^)]*\)\s*[:{]",
    re.MULTILINE,
)
_CODE_WORDS = re.compile(
    r"\b(function|python|javascript|typescript|rust|golang|java|sql|regex|refactor|compile|bug|stack trace|"
    r"unit test|implement|code)\b",
    re.IGNORECASE,
)


def detect_kind(text: str, *, hints: tuple[str, ...] = ()) -> ContentKind:
    """`code` when the text holds code, asks for code, or contains one of `hints`."""
    head = text[:_SCAN_CHARS]
    if _CODE_MARKERS.search(head) or len(_CODE_WORDS.findall(head)) >= 2:
        return "code"
    lowered = head.lower()
    if any(hint.lower() in lowered for hint in hints):
        return "code"
    return "prose"


def request_text(payload: dict[str, Any]) -> str:
    """The prompt text of a chat, completions or responses request body."""
    parts: list[str] = []
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        parts.append(prompt)
    elif isinstance(prompt, list):
        parts.extend(p for p in prompt if isinstance(p, str))
    messages = payload.get("messages") or payload.get("input")
    for message in messages if isinstance(messages, list) else []:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(c["text"] for c in content if isinstance(c, dict) and isinstance(c.get("text"), str))
    if isinstance(payload.get("input"), str):
        parts.append(payload["input"])
    return "\n".join(parts)
