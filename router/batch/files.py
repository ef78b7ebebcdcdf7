"""A batch input file, checked line by line: one request per line, as OpenAI's Batch API takes it.

    {"custom_id": "r-1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

The first line that is wrong is named in the error (1-based, as an editor counts).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

from router.errors import BadRequest
from router.request.payload import parse_json

ENDPOINTS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})


@dataclass(frozen=True, slots=True)
class Request:
    custom_id: str
    url: str
    body: str  # the request body, re-encoded compactly
    model: str | None


def parse(file: IO[bytes], *, max_lines: int, max_depth: int, max_line_bytes: int) -> Iterator[Request]:
    """The file's requests, read from where it stands line by line; BadRequest (`invalid_file`,
    naming the line) at the first bad one. Only one line at a time is in memory, and no line
    longer than `max_line_bytes`: the request it holds could not be sent."""
    seen: set[bytes] = set()  # the custom_ids' digests: a file of long ones is not held again in memory
    count = 0
    number = 0
    while raw := file.readline(max_line_bytes + 1):
        number += 1
        if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
            raise _bad(number, f"longer than {max_line_bytes} bytes (max_body_bytes), the most a request may be")
        if not raw.strip():
            continue  # a trailing newline, or blank lines between requests
        if count == max_lines:
            raise _bad(number, f"the file has more than {max_lines} requests")
        request = _request(number, raw, max_depth)
        digest = hashlib.blake2b(request.custom_id.encode(), digest_size=16).digest()
        if digest in seen:
            raise _bad(number, f"custom_id {request.custom_id!r} is used more than once")
        seen.add(digest)
        count += 1
        yield request
    if not count:
        raise BadRequest("the file has no requests", param="file", code="invalid_file")


def _request(number: int, raw: bytes, max_depth: int) -> Request:
    try:
        raw.decode("utf-8")  # JSON may be UTF-16 or -32 too; a batch file is UTF-8
    except UnicodeDecodeError as exc:
        raise _bad(number, f"not UTF-8 (byte {exc.start} of the line)") from exc
    try:
        line = parse_json(raw, max_depth=max_depth)
    except BadRequest as exc:
        raise _bad(number, exc.message) from exc
    if not isinstance(line, dict):
        raise _bad(number, "must be a JSON object")
    custom_id, method, url, body = (line.get(key) for key in ("custom_id", "method", "url", "body"))
    if not isinstance(custom_id, str) or not custom_id:
        raise _bad(number, "custom_id must be a non-empty string")
    if "\x00" in custom_id:  # kept as text: PostgreSQL's holds none
        raise _bad(number, "custom_id must not hold U+0000")
    if method != "POST":
        raise _bad(number, "method must be POST")
    if url not in ENDPOINTS:
        raise _bad(number, f"url must be one of {', '.join(sorted(ENDPOINTS))}")
    if not isinstance(body, dict):
        raise _bad(number, "body must be a JSON object")
    if body.get("stream") is True:
        raise _bad(number, "body.stream: a batch request is answered whole, not streamed")
    model = body.get("model")
    if isinstance(model, str) and "\x00" in model:  # the batch's model is kept as text too
        raise _bad(number, "body.model must not hold U+0000")
    return Request(custom_id, url, json.dumps(body, separators=(",", ":")), model if isinstance(model, str) else None)


def _bad(number: int, why: str) -> BadRequest:
    return BadRequest(f"line {number}: {why}", param="file", code="invalid_file")
