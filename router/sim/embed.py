"""`/v1/embeddings` for the simulated engine: vectors of the configured size in vLLM's shape.

A vector is the text's words hashed into its dimensions (feature hashing), normalised as vLLM
normalises an embedding model's output: texts that share words point the same way, the same
text always gives the same vector, and nothing is sampled. Embeddings do not take engine steps:
the simulated engine is a generation model, and this answers at once.
"""

from __future__ import annotations

import base64
import math
import struct
import time
import zlib
from typing import Any

from router.prompts import count_tokens
from router.sim.protocol import EngineError, not_supported

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request


def parse(body: dict[str, Any], size: int, *, max_model_len: int) -> tuple[list[list[str]], int, str]:
    """The words (or token ids) of each input, the vector size, and the encoding asked for."""
    inputs = _inputs(body.get("input"))
    for words in inputs:
        if len(words) > max_model_len:
            raise EngineError(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{len(words)} tokens in the input for embedding generation. Please reduce the length of the input.",
                param="input",
            )
    dimensions = body.get("dimensions")
    if dimensions is not None:
        if not isinstance(dimensions, int) or isinstance(dimensions, bool) or not 1 <= dimensions <= size:
            raise EngineError(f"`dimensions` must be between 1 and {size}.", param="dimensions")
        size = dimensions
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise not_supported(f"the encoding_format {encoding!r} (it answers float and base64)", param="encoding_format")
    return inputs, size, encoding


def _inputs(value: Any) -> list[list[str]]:
    if isinstance(value, str):
        return [_words(value)]
    if isinstance(value, list) and 0 < len(value) <= MAX_INPUTS:
        if _token_ids(value):
            return [[str(v) for v in value]]
        if all(isinstance(v, str) for v in value):
            return [_words(v) for v in value]
        if all(isinstance(v, list) and v and _token_ids(v) for v in value):
            return [[str(t) for t in v] for v in value]
    raise EngineError(f"`input` must be a string, a list of up to {MAX_INPUTS} strings, or token ids.", param="input")


def _token_ids(values: list[Any]) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)


def _words(text: str) -> list[str]:
    # As many pieces as the prompt counter counts tokens: the usage matches the chat endpoints'.
    words = text.lower().split()
    return words + [""] * max(0, count_tokens(text) - len(words))


def vector(words: list[str], size: int) -> list[float]:
    values = [0.0] * size
    for word in words or [""]:
        if not word:
            continue
        digest = zlib.crc32(word.encode())
        values[digest % size] += 1.0 if digest & 0x80000000 else -1.0
    if not any(values):
        values[0] = 1.0  # an empty text still has a direction, as a model's would
    norm = math.sqrt(sum(v * v for v in values))
    return [v / norm for v in values]


def response(inputs: list[list[str]], size: int, encoding: str, *, model: str, request_id: str) -> dict[str, Any]:
    data = []
    for index, words in enumerate(inputs):
        values = vector(words, size)
        embedding: list[float] | str = values
        if encoding == "base64":  # little-endian float32, as vLLM and OpenAI encode it
            embedding = base64.b64encode(struct.pack(f"<{size}f", *values)).decode()
        data.append({"index": index, "object": "embedding", "embedding": embedding})
    tokens = sum(len(words) for words in inputs)
    return {
        "id": request_id,
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": {
            "prompt_tokens": tokens,
            "total_tokens": tokens,
            "completion_tokens": 0,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        },
    }
