"""Reading a client's JSON within the depth limit: the boundary, and never a RecursionError."""

from __future__ import annotations

from typing import Any

import pytest

from router.errors import BadRequest
from router.payload import parse_json


def _nested(depth: int) -> bytes:
    return b'{"a":' * (depth - 1) + b"[1]" + b"}" * (depth - 1)


@pytest.mark.parametrize(
    ("body", "value"),
    [
        (b"{}", {}),
        (b'{"text": "[[[[[[{{{{{{"}', {"text": "[[[[[[{{{{{{"}),  # brackets in a string count for nothing
        (b"[" * 4 + b"]" * 4, [[[[]]]]),  # exactly the limit
        (_nested(4), {"a": {"a": {"a": [1]}}}),
        (b"7", 7),
    ],
)
def test_json_within_the_depth_limit_is_read(body: bytes, value: Any) -> None:
    assert parse_json(body, max_depth=4) == value


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 5 + b"]" * 5,  # one past the limit
        _nested(5),
        b"[" * 100_000 + b"]" * 100_000,  # the parser would recurse past Python's limit
        b"[" * 100_000,  # and unclosed
        b'{"a": ',
        b"\xff\xfe{",
    ],
)
def test_json_past_the_depth_limit_or_broken_is_400_invalid_json(body: bytes) -> None:
    with pytest.raises(BadRequest) as raised:
        parse_json(body, max_depth=4)
    assert raised.value.code == "invalid_json"
