"""The simulated engine's prefix cache: vLLM's automatic prefix caching, in blocks of tokens.

A request's tokens are cut into blocks of `block_size`; each full block is named by a hash of its
tokens chained to the hash of the block before it (vLLM's block hash), so a block matches only
where the whole prefix up to it matches. As in vLLM, the blocks of the answer are cached too, as
they fill: the next turn of a conversation sends that answer back in its prompt. Blocks that
running requests use are held; the others stay cached in the KV cache's free space and are
evicted least recently used first, the last block of a freed request before its first (the
order of vLLM's free block queue).
"""

from __future__ import annotations

import hashlib
import re
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from router.content import request_text

_PIECE = re.compile(r"\w+|[^\w\s]")


def text_tokens(text: str) -> list[str]:
    """The tokens `router.prompts.count_tokens` counts: a word or symbol, a long word as two."""
    out: list[str] = []
    for piece in _PIECE.findall(text):
        if len(piece) > 8:
            out += (piece[: len(piece) // 2], piece[len(piece) // 2 :])
        else:
            out.append(piece)
    return out


def chat_tokens(messages: Sequence[object]) -> list[str]:
    """A chat prompt's tokens as `chat_prompt_tokens` counts them: each message framed by four
    template tokens, three more for the assistant's turn."""
    out: list[str] = []
    for message in messages:
        role = message.get("role") if isinstance(message, dict) else None
        content = request_text({"messages": [message]}) if isinstance(message, dict) else ""
        out += ("<|start|>", str(role), "<|sep|>", *text_tokens(content), "<|end|>")
    return [*out, "<|start|>", "assistant", "<|sep|>"]


def block_hash(parent: bytes, tokens: Sequence[str]) -> bytes:
    """One block's hash, chained to its parent's (b"" for the first block)."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update("\x1f".join(tokens).encode())
    return digest.digest()


def block_hashes(tokens: Sequence[str], block_size: int) -> tuple[bytes, ...]:
    """The chained hashes of the prompt's full blocks (a partial last block is not cached)."""
    hashes: list[bytes] = []
    parent = b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start : start + block_size])
        hashes.append(parent)
    return tuple(hashes)


def tail(tokens: Sequence[str], block_size: int) -> tuple[str, ...]:
    """The tokens after the prompt's last full block: the answer's first block starts with them."""
    return tuple(tokens[len(tokens) - len(tokens) % block_size :])


class PrefixCache:
    """Cached blocks by hash: how many running requests hold each, and the free ones in LRU order."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._held: dict[bytes, int] = {}
        self._free: OrderedDict[bytes, None] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._held) + len(self._free)

    @property
    def free_tokens(self) -> int:
        """Tokens of cached blocks that no running request holds (they sit in free KV space)."""
        return len(self._free) * self.block_size

    def hit_blocks(self, blocks: Sequence[bytes], prompt_tokens: int) -> int:
        """How many leading blocks are cached; as in vLLM, at least the prompt's last token is
        computed again, so a prompt never hits whole."""
        limit = max(0, (prompt_tokens - 1) // self.block_size)
        count = 0
        for block in blocks[:limit]:
            if block not in self._held and block not in self._free:
                break
            count += 1
        return count

    def hold(self, blocks: Iterable[bytes]) -> None:
        for block in blocks:
            self._free.pop(block, None)
            self._held[block] = self._held.get(block, 0) + 1

    def release(self, blocks: Sequence[bytes]) -> None:
        """Blocks a finished request held become free, its tail the first to go."""
        for block in reversed(blocks):
            count = self._held.get(block, 0) - 1
            if count > 0:
                self._held[block] = count
            elif count == 0:
                del self._held[block]
                self._free[block] = None

    def fit(self, free_tokens: int) -> int:
        """Evict the least recently used free blocks until they fit in `free_tokens`; how many went."""
        evicted = 0
        while self._free and self.free_tokens > max(0, free_tokens):
            self._free.popitem(last=False)
            evicted += 1
        return evicted
