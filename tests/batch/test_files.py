"""A batch input file checked line by line (router/batch/files.py): what it holds in memory."""

from __future__ import annotations

import io
import json
import tracemalloc

import pytest

from router.batch import files
from router.errors import BadRequest


def _file(custom_ids: list[str]) -> io.BytesIO:
    rows = (
        {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}}
        for custom_id in custom_ids
    )
    return io.BytesIO(b"".join(json.dumps(row).encode() + b"\n" for row in rows))


def _parse(content: io.BytesIO) -> list[str]:
    return [r.custom_id for r in files.parse(content, max_lines=50_000, max_depth=64, max_line_bytes=1 << 20)]


def test_long_custom_ids_are_not_all_held_while_the_file_is_checked() -> None:
    # 2,000 lines of 10 kB custom_ids: 20 MB of them. Only their digests are kept to find a
    # repeated one, so the peak is one line and the digests, not the whole file again.
    content = _file([f"{i}-" + "x" * 10_000 for i in range(2_000)])
    tracemalloc.start()
    try:
        for _ in files.parse(content, max_lines=50_000, max_depth=64, max_line_bytes=1 << 20):
            pass
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2_000_000, peak


def test_a_repeated_custom_id_is_found_among_long_ones() -> None:
    long = "y" * 10_000
    assert _parse(_file(["a" + long, "b" + long])) == ["a" + long, "b" + long]
    with pytest.raises(BadRequest, match=r"^line 3: custom_id 'a.*' is used more than once"):
        _parse(_file(["a" + long, "b" + long, "a" + long]))
