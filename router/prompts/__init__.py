"""The prompt sets the project ships: prose and code, for the simulator and the benchmark."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

from router.content import ContentKind

_DIR = Path(__file__).resolve().parent
_TOKEN = re.compile(r"\w+|[^\w\s]")


@cache
def prompts(kind: ContentKind) -> tuple[str, ...]:
    text = (_DIR / f"{kind}.txt").read_text()
    return tuple(block.strip() for block in text.split("\n%%\n") if block.strip())


def count_tokens(text: str) -> int:
    """An estimate of a BPE tokenizer's count: a token per word or symbol, two for long words."""
    return sum(2 if len(piece) > 8 else 1 for piece in _TOKEN.findall(text))


def chat_prompt_tokens(contents: list[str]) -> int:
    """Prompt tokens of a chat request: the messages plus the chat template's few tokens each."""
    return sum(count_tokens(c) + 4 for c in contents) + 3


@cache
def prompt_of_length(kind: ContentKind, tokens: int, index: int = 0) -> str:
    """A prompt of the set, about `tokens` long as a chat request (`chat_prompt_tokens`): the
    set's texts from `index` on, joined until long enough, then cut at a word."""
    texts = prompts(kind)
    parts = [texts[index % len(texts)]]
    while chat_prompt_tokens(["\n\n".join(parts)]) < tokens:
        parts.append(texts[(index + len(parts)) % len(texts)])
    kept: list[str] = []
    count = chat_prompt_tokens([""])
    words = "\n\n".join(parts).split(" ")
    for word in words:
        count += count_tokens(word)
        if count > tokens and kept:
            break
        kept.append(word)
    return " ".join(kept)
