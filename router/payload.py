"""A client's JSON body, read within limits: never a parser that recurses without end.

Python's parser recurses once per level of nesting; a body nested ~1,000 deep makes it raise
RecursionError (a 500, had it not been caught). Any body nested deeper than `limits.json_depth`
is the client's error, 400 `invalid_json`, like a body that is not JSON at all.
"""

from __future__ import annotations

import json
from typing import Any

from router.errors import BadRequest


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
    return value


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
