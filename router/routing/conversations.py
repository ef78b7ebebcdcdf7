"""Which conversation a request continues, and which backends most likely hold its prompt's prefix.

A prompt's leading text is cut into blocks of `block_chars` characters, each named by a hash of
the whole text up to its end (llm-d's estimated prefix scorer, without a tokenizer), salted with
the model. A block placed on a backend lately is likely still cached there, and with it every
block before it. A conversation is named by the session header when the client sends one
(scoped to the client and the model), else by its first blocks; what is kept of it is where it
was last placed and when it last changed pools.

Both tables are bounded: a cap on entries, the least recently used out first, and an age past
which an entry counts for nothing. A flood of distinct prompts or sessions only turns them over.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from router.config import Conversations

CHARS_PER_TOKEN = 4  # as router.content estimates a prompt's tokens
_KEY_BLOCKS = 4  # the blocks that name a conversation without a session header


@dataclass(frozen=True, slots=True)
class Prompt:
    """One request as the index sees it."""

    key: bytes  # its conversation
    named: bool  # ...named by the session header, not by its leading text
    blocks: tuple[bytes, ...]  # hashes of its leading blocks, each covering all text before it
    tokens: int  # its prompt's tokens, estimated


@dataclass(frozen=True, slots=True)
class Conversation:
    """Where a conversation was last placed, and when it last changed pools."""

    pool: str
    backend: str
    moved_at: float
    seen_at: float


@dataclass(frozen=True, slots=True)
class Cached:
    """What the index knows of one request at its decision: the snapshot prices its prefill."""

    tokens: int  # its prompt's tokens, estimated
    held: Mapping[str, int]  # tokens of its prefix each backend most likely holds
    home: str | None = None  # the pool its conversation was last placed in
    settled: bool = False  # ...having moved there within `settle_seconds`
    last: str | None = None  # ...and the backend, for a conversation named by its session


class ConversationIndex:
    def __init__(self, config: Conversations | None = None) -> None:
        self.config = config or Conversations()
        self._blocks: OrderedDict[bytes, dict[str, float]] = OrderedDict()  # block -> backend -> placed at
        self._conversations: OrderedDict[bytes, Conversation] = OrderedDict()

    def configure(self, config: Conversations) -> None:
        self.config = config
        self._trim()

    def __len__(self) -> int:
        return len(self._blocks) + len(self._conversations)

    def prompt(
        self, payload: Mapping[str, Any], headers: Mapping[str, str], *, client: str, text: str
    ) -> Prompt | None:
        """The request's conversation and blocks; None for a request with no prompt to place.
        `text`: the payload's `request_text`, read once for every stage."""
        if not text:
            return None
        config = self.config
        model = payload.get("model")
        digest = hashlib.blake2b(f"{model if isinstance(model, str) else ''}\x00".encode(), digest_size=16)
        blocks = []
        size = config.block_chars
        for start in range(0, min(len(text) // size, config.max_blocks) * size, size):
            digest.update(text[start : start + size].encode("utf-8", "surrogatepass"))
            blocks.append(digest.copy().digest())
        session = headers.get(config.session_header.lower())
        if session:
            key = hashlib.blake2b(f"{client}\x00{model}\x00{session}".encode(), digest_size=16).digest()
        elif blocks:
            key = blocks[min(len(blocks), _KEY_BLOCKS) - 1]
        else:
            key = digest.digest()  # a prompt shorter than a block: its whole text
        return Prompt(key, bool(session), tuple(blocks), -(-len(text) // CHARS_PER_TOKEN))

    def held(self, prompt: Prompt, now: float) -> dict[str, int]:
        """Each backend's tokens of the prompt's prefix that it most likely holds."""
        oldest = now - self.config.max_age
        held: dict[str, int] = {}
        for count, block in enumerate(prompt.blocks, start=1):
            placed = self._blocks.get(block)
            if not placed:
                break
            for backend, at in placed.items():
                if at >= oldest:
                    held[backend] = count
        per_block = self.config.block_chars // CHARS_PER_TOKEN
        return {backend: count * per_block for backend, count in held.items()}

    def conversation(self, prompt: Prompt, now: float) -> Conversation | None:
        found = self._conversations.get(prompt.key)
        if found is None or found.seen_at < now - self.config.max_age:
            return None
        return found

    def cached(self, prompt: Prompt, now: float) -> Cached:
        conversation = self.conversation(prompt, now)
        if conversation is None:
            return Cached(prompt.tokens, self.held(prompt, now))
        settled = now - conversation.moved_at < self.config.settle_seconds
        # Without a session, where the text went is what `held` knows: a prompt shorter than a
        # block is no reason to keep to one backend.
        last = conversation.backend if prompt.named else None
        return Cached(prompt.tokens, self.held(prompt, now), conversation.pool, settled, last)

    def placed(self, prompt: Prompt, *, backend: str, pool: str, now: float) -> None:
        """The prompt went to `backend`: its blocks are cached there from now on."""
        for block in prompt.blocks:
            placed = self._blocks.get(block)
            if placed is None:
                self._blocks[block] = {backend: now}
            else:
                placed[backend] = now
                self._blocks.move_to_end(block)
        before = self.conversation(prompt, now)
        moved_at = now  # changed pools now; a first placement is no move
        if before is None:
            moved_at = -math.inf
        elif before.pool == pool:
            moved_at = before.moved_at
        self._conversations[prompt.key] = Conversation(pool, backend, moved_at, now)
        self._conversations.move_to_end(prompt.key)
        self._trim()

    def _trim(self) -> None:
        config = self.config
        while len(self._blocks) > config.max_entries:
            self._blocks.popitem(last=False)
        while len(self._conversations) > config.max_conversations:
            self._conversations.popitem(last=False)
