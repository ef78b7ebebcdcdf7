"""A client's body, read within limits: never more bytes than allowed, never for longer than
allowed, and never a JSON parser that recurses without end.

`body_chunks` and `read_body` are the one reader of request bodies (the proxy's and the Batch
API's): a body declared or found over its limit is 413, one that does not arrive within its time
is 408, and a client that hangs up raises `ClientGone`.

Python's JSON parser recurses once per level of nesting; a body nested ~1,000 deep makes it raise
RecursionError (a 500, had it not been caught). Any body nested deeper than `limits.json_depth`
is the client's error, 400 `invalid_json`, like a body that is not JSON at all. So is a string
with a lone UTF-16 surrogate (`"\\ud800"`, or its three bytes, which no UTF-8 has): Python's
parser takes it, but it is no text, and every later `.encode()` of it (a hash, a log line, the
body sent on) would raise.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncGenerator
from typing import Any

from starlette.types import Receive

from router.errors import BadRequest, PayloadTooLarge, RequestTimeout

# \ud800-\udfff, one half of a pair or alone, escaped or encoded (json.loads decodes surrogatepass)
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


class ClientGone(Exception):
    """The client closed its connection."""


async def body_chunks(
    receive: Receive, *, limit: int, within: float, declared: str | None = None, code: str = "body_too_large"
) -> AsyncGenerator[bytes, None]:
    """The request body as it arrives, at most `limit` bytes in all, within `within` seconds of
    the first read. `declared` is the request's Content-Length: a body declared too large is
    refused before a byte of it is read. `code` names the limit in the 413."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit, code)
    deadline = asyncio.get_running_loop().time() + within
    size = 0
    more_body = True
    while more_body:
        # The deadline is held only around each wait, never across a yield: the consumer's work
        # (a disk write) is not the client's delay, and a cancel scope must not span a yield.
        # asyncio's own timeout: anyio's `fail_after` costs a cancel scope and its bookkeeping
        # on every read, which at one read per request showed in the profile.
        try:
            async with asyncio.timeout_at(deadline):
                message = await receive()
        except TimeoutError as exc:
            raise RequestTimeout(f"request body not received within {within:g} s", code="body_timeout") from exc
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit, code)
        more_body = message.get("more_body", False)
        if chunk:
            yield chunk


async def read_body(
    receive: Receive, *, limit: int, within: float, declared: str | None = None, code: str = "body_too_large"
) -> bytes:
    """The whole request body, read as `body_chunks` reads it, in one deadline: no generator and
    no timer per read (most bodies are one read, whole before the app is called)."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit, code)
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(within):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone
                chunk: bytes = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise _too_large(limit, code)
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
    except TimeoutError as exc:
        raise RequestTimeout(f"request body not received within {within:g} s", code="body_timeout") from exc


def _too_large(limit: int, code: str) -> PayloadTooLarge:
    return PayloadTooLarge(f"request body is over the {limit} byte limit", code=code)


def parse_json(body: bytes, *, max_depth: int) -> Any:
    """The JSON value of `body`, or BadRequest (`invalid_json`)."""
    try:
        value = json.loads(body)
    except RecursionError as exc:
        raise _too_deep(max_depth) from exc
    except ValueError as exc:  # UnicodeDecodeError too
        raise BadRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from exc
    # Only a body with more than max_depth brackets can be that deep: most never need the walk.
    if body.count(b"[") + body.count(b"{") > max_depth and _deeper_than(value, max_depth):
        raise _too_deep(max_depth)
    # Only a body with such an escape or bytes can hold a lone surrogate: most never need the check.
    if _SURROGATE.search(body) and not _is_text(value):
        raise BadRequest("request body is not valid JSON: a string holds a lone UTF-16 surrogate", code="invalid_json")
    return value


def _is_text(value: Any) -> bool:
    """Whether every string in `value` encodes as UTF-8 (a surrogate pair parses to one character)."""
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return False
    return True


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether `value` nests more than `limit` arrays and objects; level by level, no recursion."""
    level = [value]
    for _ in range(limit + 1):
        containers = [item for item in level if isinstance(item, dict | list)]
        if not containers:
            return False
        level = [child for item in containers for child in (item.values() if isinstance(item, dict) else item)]
    return True


def _too_deep(max_depth: int) -> BadRequest:
    return BadRequest(f"request body is nested more than {max_depth} levels deep", code="invalid_json")
