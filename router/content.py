"""Cheap detection of what a request is about: prose or code.

Speculative decoding pays off more on code, which a drafter guesses well, than on prose. The
simulator uses this to pick an acceptance rate; the router uses it to decide where the
speculative pool still pays. Only a bounded prefix and suffix of the text are looked at.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

import re2

ContentKind = Literal["prose", "code"]
CONTENT_KINDS: tuple[ContentKind, ...] = get_args(ContentKind)

# Only a prefix and a suffix of the prompt are read: the system prompt and the question are where
# a request says what it is about, and the cost per request stays bounded.
_SCAN_CHARS = 8192
# RE2, not `re`: client text must never make the event loop backtrack. On Python's engine
# `\w+\(` alone spent seconds on "a" * 8190 + "(" (every start position ran to the end); RE2
# runs in time linear in the text, whatever the pattern (docs/benchmarks.md). Its `\w` and `\b`
# are ASCII-only.
_CODE_MARKERS = re2.compile(
    r"(?m)```|^\s*(def|class|import|from|fn|func|function|const|let|var|public|private|#include|package|"
    r"SELECT|return)\b|[{};]\s*$|=>|->|::|\w+\([^)]*\)\s*[:{]"
)
_CODE_WORDS = re2.compile(
    r"(?i)\b(function|python|javascript|typescript|rust|golang|java|sql|regex|refactor|compile|bug|stack trace|"
    r"unit test|implement|code)\b"
)


def detect_kind(text: str, *, hints: tuple[str, ...] = ()) -> ContentKind:
    """`code` when the text holds code, asks for code, or contains one of `hints`."""
    if len(text) > 2 * _SCAN_CHARS:
        text = text[:_SCAN_CHARS] + "\n" + text[-_SCAN_CHARS:]
    if _CODE_MARKERS.search(text) or len(_CODE_WORDS.findall(text)) >= 2:
        return "code"
    lowered = text.lower()
    if any(hint.lower() in lowered for hint in hints):
        return "code"
    return "prose"


def request_text(payload: Mapping[str, Any]) -> str:
    """The prompt text of a chat, completions or responses request body."""
    return "\n".join(_prompt_parts(payload))


@dataclass(frozen=True, slots=True)
class PromptText:
    """A request body's prompt, read once for every stage that looks at it."""

    text: str  # `request_text`
    tokens: int  # the prompt's, estimated (`_prompt_tokens`)
    total: int | None  # at the request's end, estimated (`_request_tokens`)


def read_prompt(payload: Mapping[str, Any]) -> PromptText:
    """A body's `request_text` and its prompt's and whole request's tokens, in one pass over its prompt."""
    text = request_text(payload)
    return PromptText(text, _prompt_tokens(payload, len(text)), _request_tokens(payload, len(text)))


def _prompt_parts(payload: Mapping[str, Any]) -> list[str]:
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
    return parts


# Characters per token of the prompt, for an estimate without a tokenizer (English text and code
# run 3.5-4.5 to a token on the tokenizers of today's models).
_CHARS_PER_TOKEN = 4
_ANSWER_LIMITS = ("max_completion_tokens", "max_tokens", "max_output_tokens")


def _prompt_tokens(payload: Mapping[str, Any], chars: int) -> int:
    """The prompt's tokens, estimated from its length (`chars`: of the body's `request_text`; what a
    rate limit takes on arrival); a prompt or input given as token ids, one a token, and an input
    given as a list of texts too."""
    text = -(-chars // _CHARS_PER_TOKEN)
    return text + _listed(payload.get("prompt"), texts=False) + _listed(payload.get("input"), texts=True)


def _listed(value: object, *, texts: bool) -> int:
    """Tokens of a list `_prompt_parts` does not read: token ids, lists of them, and (`texts`) strings."""
    if not isinstance(value, list):
        return 0
    tokens = 0
    for item in value:
        if isinstance(item, int):
            tokens += 1
        elif isinstance(item, list):
            tokens += len(item)
        elif texts and isinstance(item, str):
            tokens += -(-len(item) // _CHARS_PER_TOKEN)
    return tokens


def _request_tokens(payload: Mapping[str, Any], chars: int) -> int | None:
    """The tokens a request holds at its end, estimated: its prompt (`chars`: the length of the
    body's `request_text`) and the longest answers it allows (`n` of them). None when it sets no
    answer limit: the engine's own default is not known."""
    limit = next((count for key in _ANSWER_LIMITS if (count := _count(payload.get(key)))), None)
    if limit is None:
        return None
    return -(-chars // _CHARS_PER_TOKEN) + (_count(payload.get("n")) or 1) * limit


def _count(value: object) -> int | None:
    """A positive integer (not a bool, which Python counts as one), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
