"""An upload to `POST /v1/files`, taken as it arrives: the file part goes to disk, never whole
into memory.

python-multipart's streaming parser (the one under Starlette's `request.form()`) reads the
multipart body chunk by chunk; its callbacks here write the file part to a temporary file the
store gives (beside its data, not in a RAM-backed /tmp) and keep the few small fields in memory.
Everything is bounded: the body by the file's limit plus room for the multipart framing, the
file part by its limit, the other fields by count and size, each part's headers by size, and
the whole body by a time. The file's limit is `max_file_bytes` or the room left in the store,
whichever is less: a body declared too large for it is refused before a temporary file is made
(`refuse_declared`), one found too large as it arrives as soon as it passes it. A body that ends
before its closing boundary is 400: the parser alone would take it as complete.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING

import anyio
from python_multipart import MultipartParser
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import parse_options_header
from starlette.requests import Request

from router.errors import BadRequest, PayloadTooLarge
from router.request.payload import body_chunks

if TYPE_CHECKING:
    from python_multipart.multipart import MultipartCallbacks

# Boundaries, part headers and the small fields around the file: the body may exceed the file by this.
MULTIPART_OVERHEAD = 64 * 1024
_MAX_PARTS = 8  # the file, `purpose`, and a few fields other clients send
_MAX_FIELD_BYTES = 1024  # a field other than the file (`purpose`: a word)
_MAX_HEADER_BYTES = 8 * 1024  # a part's headers in all (python-multipart bounds them only lately)


@dataclass(frozen=True, slots=True)
class Upload:
    filename: str | None  # None: no file part came
    size: int  # bytes of the file part, written to the file given
    fields: dict[str, str]  # the other parts, e.g. {"purpose": "batch"}


def refuse_declared(request: Request, *, max_file_bytes: int, room: int) -> None:
    """413 at once if the request's Content-Length alone says its file is over `max_file_bytes`,
    or over the `room` left in the store: before a temporary file is made or a byte is read."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > min(max_file_bytes, room) + MULTIPART_OVERHEAD:
        raise _too_large(max_file_bytes, room)


async def receive_upload(request: Request, file: IO[bytes], *, max_file_bytes: int, room: int, within: float) -> Upload:
    """Read the multipart body of `request`, writing its part `file` to `file`.

    400 `invalid_multipart` for a body that is not well-formed multipart, 413 `file_too_large`
    past the size limits or `storage_full` past the `room` left in the store, 408 `body_timeout`
    past `within` seconds; `router.payload.ClientGone` if the client leaves. `file` holds what
    was written so far whatever happens: its owner discards it."""
    kind, options = parse_options_header(request.headers.get("content-type"))
    boundary = options.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise _malformed("the body must be multipart/form-data with a boundary")
    parts = _Parts(file, max_file_bytes=max_file_bytes, room=room)
    try:
        parser = MultipartParser(boundary, parts.callbacks())
    except FormParserError as exc:
        raise _malformed(str(exc)) from exc
    chunks = body_chunks(
        request.receive,
        limit=min(max_file_bytes, room) + MULTIPART_OVERHEAD,
        within=within,
        declared=request.headers.get("content-length"),
        code="file_too_large",
    )
    try:
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                try:
                    # The callbacks write to disk: off the event loop.
                    await anyio.to_thread.run_sync(parser.write, chunk)
                except FormParserError as exc:
                    raise _malformed(str(exc)) from exc
    except PayloadTooLarge as exc:  # the body, or the file part in it: both are the file's limit
        raise _too_large(max_file_bytes, room) from exc
    if not parts.ended:
        raise _malformed("the body ends before the closing boundary")
    return Upload(parts.filename, parts.size, parts.fields)


@dataclass(slots=True)
class _Parts:
    """python-multipart's callbacks: the file part to `file`, the other parts to `fields`."""

    file: IO[bytes]
    max_file_bytes: int
    room: int  # left in the store
    filename: str | None = None
    size: int = 0
    fields: dict[str, str] = field(default_factory=dict)
    ended: bool = False  # the closing boundary was read
    _parts: int = 0
    _header_bytes: int = 0
    _header_name: bytearray = field(default_factory=bytearray)
    _header_value: bytearray = field(default_factory=bytearray)
    _disposition: bytes = b""
    _name: str = ""
    _value: bytearray = field(default_factory=bytearray)
    _in_file: bool = False

    def callbacks(self) -> MultipartCallbacks:
        return {
            "on_part_begin": self._part_begin,
            "on_header_field": self._header_field,
            "on_header_value": self._header_value_data,
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._part_data,
            "on_part_end": self._part_end,
            "on_end": self._end,
        }

    def _part_begin(self) -> None:
        self._parts += 1
        if self._parts > _MAX_PARTS:
            raise _malformed(f"more than {_MAX_PARTS} parts")
        self._disposition = b""
        self._in_file = False
        self._header_bytes = 0

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._count_header(end - start)
        self._header_name += data[start:end]

    def _header_value_data(self, data: bytes, start: int, end: int) -> None:
        self._count_header(end - start)
        self._header_value += data[start:end]

    def _count_header(self, size: int) -> None:
        self._header_bytes += size
        if self._header_bytes > _MAX_HEADER_BYTES:
            raise _malformed(f"a part's headers are over {_MAX_HEADER_BYTES} bytes")

    def _header_end(self) -> None:
        if self._header_name.lower() == b"content-disposition":
            self._disposition = bytes(self._header_value)
        self._header_name.clear()
        self._header_value.clear()

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        name = options.get(b"name")
        if name is None:
            raise _malformed("a part without a name (Content-Disposition: form-data; name=...)")
        self._name = name.decode("latin-1")
        if b"filename" not in options:
            self._value = bytearray()
            return
        if self._name != "file" or self.filename is not None:
            raise _malformed("one file is taken, in the part named 'file'")
        self.filename = _text(options[b"filename"]) or "upload.jsonl"
        self._in_file = True

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._in_file:
            self.size += end - start
            if self.size > min(self.max_file_bytes, self.room):
                raise _too_large(self.max_file_bytes, self.room)
            self.file.write(data[start:end])
            return
        if len(self._value) + end - start > _MAX_FIELD_BYTES:
            raise _malformed(f"the field {self._name!r} is over {_MAX_FIELD_BYTES} bytes")
        self._value += data[start:end]

    def _part_end(self) -> None:
        if not self._in_file:
            self.fields[self._name] = _text(bytes(self._value))

    def _end(self) -> None:
        self.ended = True


def _text(raw: bytes) -> str:
    """A field or file name: UTF-8 as browsers and the SDKs send it, else each byte as it is; a
    NUL as U+FFFD (PostgreSQL's text holds none)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("latin-1")
    return text.replace("\x00", "\ufffd")


def _too_large(max_file_bytes: int, room: int) -> PayloadTooLarge:
    """The 413 for a file over its limit: the store's room if that is the lesser."""
    if room < max_file_bytes:
        why = f"no room for the file: the batch store has {room} bytes left"
        return PayloadTooLarge(why, param="file", code="storage_full")
    why = f"the file is over the {max_file_bytes} byte limit"
    return PayloadTooLarge(why, param="file", code="file_too_large")


def _malformed(why: str) -> BadRequest:
    return BadRequest(f"malformed multipart body: {why}", code="invalid_multipart")
