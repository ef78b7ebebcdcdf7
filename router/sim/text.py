"""Readable generated text, a token at a time: prose for prose prompts, code for code prompts."""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

from router.content import ContentKind

_SUBJECTS = (
    "The harbour",
    "An old map",
    "The committee",
    "Every morning",
    "The river",
    "A quiet street",
    "The first printer",
    "The new library",
    "Her grandfather",
    "The village school",
    "The market",
)
_VERBS = (
    "carried",
    "changed",
    "remembered",
    "explained",
    "opened",
    "followed",
    "measured",
    "welcomed",
    "shaped",
    "described",
    "questioned",
    "protected",
)
_OBJECTS = (
    "the slow rhythm of the tides",
    "a story that nobody had written down",
    "the cost of every decision",
    "the light over the northern hills",
    "a careful record of the seasons",
    "the habits of a whole town",
    "the promise of a better harvest",
    "the voices of the people who stayed",
    "a plan for the coming years",
)
_TAILS = (
    "and the evening grew calm.",
    "while the rain kept falling.",
    "because nothing else seemed possible.",
    "long before anyone noticed.",
    "as the bells rang across the square.",
    "with patience and some luck.",
)
_CODE = (
    "def {name}(items: list[int]) -> int:",
    "    total = 0",
    "    for item in items:",
    "        if item > {n}:",
    "            total += item * {n}",
    "    return total",
    "",
    "class {cls}:",
    "    def __init__(self, size: int = {n}) -> None:",
    "        self.size = size",
    "        self.cache: dict[str, int] = {{}}",
    "",
    "    def get(self, key: str) -> int | None:",
    "        return self.cache.get(key)",
    "",
    "",
    "def test_{name}() -> None:",
    "    assert {name}([1, 2, {n}]) >= 0",
    "",
)
_NAMES = ("compute_total", "merge_records", "parse_line", "load_config", "rate_limit", "find_first")
_CLASSES = ("LRUCache", "TokenBucket", "RecordStore", "Parser", "RetryPolicy")
_CODE_TOKEN = re.compile(r"\n[ ]*|[ ]?\w+|[ ]?[^\w\s]")


def tokens(kind: ContentKind, rng: random.Random) -> Iterator[str]:
    """An endless supply of text pieces, each standing for one token."""
    if kind == "code":
        yield "```python"
        while True:
            names = {"name": rng.choice(_NAMES), "cls": rng.choice(_CLASSES), "n": rng.randint(2, 99)}
            block = "\n" + "\n".join(line.format(**names) for line in _CODE)
            yield from _CODE_TOKEN.findall(block)
    first = True
    while True:
        sentence = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}"
        for word in sentence.split(" "):
            yield word if first else " " + word
            first = False
        if rng.random() < 0.2:
            yield "\n\n"
            first = True
