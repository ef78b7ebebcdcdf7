"""The Files and Batches endpoints, shaped as OpenAI's (`client.files.*`, `client.batches.*`).

Every file and batch belongs to the client that created it: the SHA-256 of its API key (the
key itself is never stored). With no client keys configured, the bearer token a client sends
still names its space — a separation, not a security boundary — and a client that sends none
is `anonymous`. Another client asking for it gets 404, as if it did not exist.
"""

from __future__ import annotations

import hashlib
import io
import re
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import IO, TYPE_CHECKING, Any, overload

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Mount, Route

from router.batch import files
from router.batch.store import BatchRecord, FileRecord, StorageFull
from router.batch.upload import receive_upload, refuse_declared
from router.errors import BadRequest, Conflict, NotFound, PayloadTooLarge
from router.request.headers import bearer
from router.request.payload import ClientGone, parse_json, read_body

if TYPE_CHECKING:
    from router.batch.service import BatchService

_WINDOW_SECONDS = {"24h": 24 * 3600}
_JSON_LIMIT = 1024 * 1024  # a create-batch body
_CHUNK = 256 * 1024  # a file's content goes out this much at a time
_MODEL_CHARS = 256  # a batch's `model`, shown in every list of batches: a name, not a line's worth
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # every id and purpose the store may hold


def batch_routes(service: BatchService) -> list[BaseRoute]:
    """The routes, to be listed before the proxy's catch-all `POST /v1/{path}`."""
    api = _Api(service)
    return [
        Route("/v1/files", api.upload, methods=["POST"]),
        Route("/v1/files", api.list_files, methods=["GET"]),
        Mount(
            "/v1/files",
            routes=[
                Route("/{file_id}", api.get_file, methods=["GET"]),
                Route("/{file_id}", api.delete_file, methods=["DELETE"]),
                Route("/{file_id}/content", api.content, methods=["GET"]),
            ],
        ),
        Route("/v1/batches", api.create, methods=["POST"]),
        Route("/v1/batches", api.list_batches, methods=["GET"]),
        Mount(
            "/v1/batches",
            routes=[
                Route("/{batch_id}", api.get_batch, methods=["GET"]),
                Route("/{batch_id}/cancel", api.cancel, methods=["POST"]),
            ],
        ),
    ]


class _Api:
    def __init__(self, service: BatchService) -> None:
        self._service = service

    def _owner(self, request: Request) -> str:
        key = bearer(request.headers.get("authorization"))
        self._service.router.plan.auth.check_client(key)
        return "key:" + hashlib.sha256(key.encode()).hexdigest() if key else "anonymous"

    # Files.

    async def upload(self, request: Request) -> Response:
        owner = self._owner(request)
        config, store = self._service.config, self._service.store
        # The room left now: a file the store cannot take is refused as soon as that shows,
        # before a byte of it reaches the disk if its Content-Length says so. The store still
        # has the last word (`StorageFull`): another upload may take the room meanwhile.
        room = max(0, config.max_storage_bytes - await anyio.to_thread.run_sync(store.used_bytes))
        refuse_declared(request, max_file_bytes=config.max_file_bytes, room=room)
        spool = await anyio.to_thread.run_sync(store.temporary_file)
        try:
            try:
                form = await receive_upload(
                    request, spool, max_file_bytes=config.max_file_bytes, room=room, within=config.upload_timeout
                )
            except ClientGone:
                return Response(status_code=499)  # nobody is left to answer
            if form.filename is None:
                raise BadRequest("a multipart field 'file' is required", param="file", code="missing_file")
            if form.fields.get("purpose") != "batch":
                raise BadRequest("purpose must be 'batch': this router keeps batch files only", param="purpose")
            record = FileRecord(_new_id("file-"), owner, form.filename[:255], "batch", form.size, self._service.now())
            await anyio.to_thread.run_sync(lambda: self._check(spool))
            try:
                await anyio.to_thread.run_sync(lambda: store.add_file(record, spool, limit=config.max_storage_bytes))
            except StorageFull as exc:
                raise PayloadTooLarge(f"no room for the file: {exc}", param="file", code="storage_full") from exc
        finally:
            await _discard(spool)
        return JSONResponse(_file(record))

    def _check(self, content: IO[bytes]) -> None:
        """Every line of an input file, checked as `files.parse` checks it (BadRequest at the first bad one)."""
        content.seek(0)
        for _ in self._parse(content):
            pass

    async def list_files(self, request: Request) -> Response:
        owner = self._owner(request)
        query = request.query_params
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise BadRequest("order must be 'asc' or 'desc'", param="order")
        limit = _limit(query.get("limit"), default=10_000, most=10_000)
        purpose, after = _stored(query.get("purpose")), _stored(query.get("after"))
        found, more = await anyio.to_thread.run_sync(
            lambda: self._service.store.list_files(
                owner, purpose=purpose, after=after, limit=limit, newest_first=order == "desc"
            )
        )
        return JSONResponse(_page([_file(record) for record in found], more))

    async def _find_file(self, request: Request) -> tuple[str, FileRecord]:
        owner = self._owner(request)
        return owner, await self._file_record(owner, request.path_params["file_id"], param="file_id")

    async def _file_record(self, owner: str, file_id: str, *, param: str) -> FileRecord:
        record = await anyio.to_thread.run_sync(self._service.store.get_file, owner, _stored(file_id))
        if record is None:
            raise NotFound(f"No such File object: {file_id}", param=param, code="file_not_found")
        return record

    async def get_file(self, request: Request) -> Response:
        _, record = await self._find_file(request)
        return JSONResponse(_file(record))

    async def content(self, request: Request) -> Response:
        owner, record = await self._find_file(request)
        spool, done = await self._copy(owner, record, param="file_id")
        size = spool.seek(0, io.SEEK_END)
        spool.seek(0)
        body = _chunks(spool, done)
        return StreamingResponse(body, media_type="application/jsonl", headers={"content-length": str(size)})

    async def _copy(self, owner: str, record: FileRecord, *, param: str) -> tuple[IO[bytes], Callable[[], object]]:
        """A copy of the file's content in a temporary file (whole, even if it is deleted meanwhile),
        for the caller to read at its pace and close, then call `done`; NotFound if there is no
        such file; 503 while the copies open take `max_storage_bytes` (copies.py)."""
        store = self._service.store
        self._service.copies.take(record.bytes, most=self._service.config.max_storage_bytes)
        try:
            spool = await anyio.to_thread.run_sync(store.temporary_file)
        except BaseException:
            self._service.copies.give_back(record.bytes)
            raise
        done = self._service.copies.track(spool, record.bytes)
        try:
            found = await anyio.to_thread.run_sync(store.copy_file, owner, record.id, spool)
        except BaseException:
            spool.close()
            done()
            raise
        if not found:
            spool.close()
            done()
            raise NotFound(f"No such File object: {record.id}", param=param, code="file_not_found")
        return spool, done

    async def delete_file(self, request: Request) -> Response:
        owner, record = await self._find_file(request)
        deleted = await anyio.to_thread.run_sync(self._service.store.delete_file, owner, record.id)
        return JSONResponse({"id": record.id, "object": "file", "deleted": deleted})

    def _parse(self, content: IO[bytes]) -> Iterator[files.Request]:
        plan = self._service.router.plan
        return files.parse(
            content,
            max_lines=self._service.config.max_lines,
            max_depth=plan.json_depth,
            max_line_bytes=plan.max_body_bytes,
        )

    # Batches.

    async def create(self, request: Request) -> Response:
        owner = self._owner(request)
        try:
            raw = await read_body(
                request.receive,
                limit=_JSON_LIMIT,
                within=self._service.router.plan.client_body_seconds,
                declared=request.headers.get("content-length"),
            )
        except ClientGone:
            return Response(status_code=499)  # nobody is left to answer
        params = parse_json(raw, max_depth=self._service.router.plan.json_depth)
        if not isinstance(params, dict):
            raise BadRequest("request body must be a JSON object", code="invalid_json")
        endpoint, window, file_id = params.get("endpoint"), params.get("completion_window"), params.get("input_file_id")
        metadata = params.get("metadata")
        if endpoint not in files.ENDPOINTS:
            raise BadRequest(f"endpoint must be one of {', '.join(sorted(files.ENDPOINTS))}", param="endpoint")
        if window not in _WINDOW_SECONDS:
            raise BadRequest("completion_window must be '24h'", param="completion_window")
        if not isinstance(file_id, str):
            raise BadRequest("input_file_id is required", param="input_file_id")
        if metadata is not None and not (
            isinstance(metadata, dict)
            and len(metadata) <= 16
            and all(
                isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                for k, v in metadata.items()
            )
        ):
            raise BadRequest("metadata: at most 16 string keys (64 chars) and values (512 chars)", param="metadata")
        input_file = await self._file_record(owner, file_id, param="input_file_id")
        spool, done = await self._copy(owner, input_file, param="input_file_id")
        try:
            total, model, errors = await anyio.to_thread.run_sync(self._survey, spool, endpoint)
            now = self._service.now()
            record = BatchRecord(
                id=_new_id("batch_"),
                owner=owner,
                status="failed" if errors else "validating",
                endpoint=endpoint,
                input_file_id=file_id,
                completion_window=window,
                model=model,
                metadata=metadata,
                errors=errors or None,
                created_at=now,
                expires_at=now + _WINDOW_SECONDS[window],
                failed_at=now if errors else None,
                total=0 if errors else total,
            )
            spool.seek(0)
            # Read from the file again as they go into the store: never all in memory at once.
            lines = () if errors else ((r.custom_id, r.url, r.body) for r in self._parse(spool))
            limit = self._service.config.max_storage_bytes
            try:
                await anyio.to_thread.run_sync(lambda: self._service.store.create_batch(record, lines, limit=limit))
            except StorageFull as exc:
                why = f"no room for the batch's copy of its lines: {exc}"
                raise PayloadTooLarge(why, param="input_file_id", code="storage_full") from exc
        finally:
            await _discard(spool)
            done()
        self._service.runner.wake()
        return JSONResponse(_batch(record))

    def _survey(self, content: IO[bytes], endpoint: str) -> tuple[int, str | None, list[dict[str, Any]]]:
        """How many requests an input file has, the first model it names (of at most 256
        characters), and (at most 100) lines whose url is not the batch's endpoint."""
        content.seek(0)
        total, model = 0, None
        errors: list[dict[str, Any]] = []
        for total, request in enumerate(self._parse(content), start=1):
            if model is None and request.model is not None and len(request.model) <= _MODEL_CHARS:
                model = request.model
            if request.url != endpoint and len(errors) < 100:
                errors.append(
                    {
                        "code": "invalid_url",
                        "line": total,
                        "message": f"url {request.url!r} does not match the batch's endpoint {endpoint!r}",
                        "param": "url",
                    }
                )
        return total, model, errors

    async def list_batches(self, request: Request) -> Response:
        owner = self._owner(request)
        limit = _limit(request.query_params.get("limit"), default=20, most=100)
        after = _stored(request.query_params.get("after"))
        found, more = await anyio.to_thread.run_sync(
            lambda: self._service.store.list_batches(owner, after=after, limit=limit)
        )
        return JSONResponse(_page([_batch(record) for record in found], more))

    async def _find_batch(self, request: Request) -> tuple[str, BatchRecord]:
        owner = self._owner(request)
        batch_id = request.path_params["batch_id"]
        record = await anyio.to_thread.run_sync(self._service.store.get_batch, owner, _stored(batch_id))
        if record is None:
            raise NotFound(f"No such Batch object: {batch_id}", param="batch_id", code="batch_not_found")
        return owner, record

    async def get_batch(self, request: Request) -> Response:
        _, record = await self._find_batch(request)
        return JSONResponse(_batch(record))

    async def cancel(self, request: Request) -> Response:
        owner, record = await self._find_batch(request)
        if record.status in ("cancelling", "cancelled"):
            return JSONResponse(_batch(record))
        if record.status not in ("validating", "in_progress"):
            raise Conflict(f"a batch that is {record.status} cannot be cancelled", code="batch_not_cancellable")
        cancelled = await anyio.to_thread.run_sync(self._service.store.cancel, owner, record.id, self._service.now())
        self._service.runner.wake()
        return JSONResponse(_batch(cancelled or record))


async def _discard(file: IO[bytes]) -> None:
    """Close a temporary file, and so remove it (it never had a name), even in a request being
    cancelled."""
    with anyio.CancelScope(shield=True):
        await anyio.to_thread.run_sync(file.close)


async def _chunks(file: IO[bytes], done: Callable[[], object]) -> AsyncIterator[bytes]:
    """`file` from where it stands, a chunk at a time; closed (then `done`) at its end, or when
    the client leaves (the response is cancelled there)."""
    try:
        while chunk := await anyio.to_thread.run_sync(file.read, _CHUNK):
            yield chunk
    finally:
        file.close()
        done()


def _limit(value: str | None, *, default: int, most: int) -> int:
    if value is None:
        return default
    if not (value.isascii() and value.isdigit()) or not 1 <= int(value) <= most:  # not "²", say
        raise BadRequest(f"limit must be an integer from 1 to {most}", param="limit")
    return int(value)


@overload
def _stored(name: str) -> str: ...
@overload
def _stored(name: None) -> None: ...
def _stored(name: str | None) -> str | None:
    """A client's id or purpose as the store is asked for it: one the store cannot hold (a NUL,
    which PostgreSQL refuses outright, 10 kB, a path) names nothing there, as "" does."""
    return name if name is None or _NAME.fullmatch(name) else ""


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def _page(data: list[dict[str, Any]], more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": more,
    }


def _file(record: FileRecord) -> dict[str, Any]:
    return {
        "id": record.id,
        "object": "file",
        "bytes": record.bytes,
        "created_at": record.created_at,
        "filename": record.filename,
        "purpose": record.purpose,
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }


def _batch(record: BatchRecord) -> dict[str, Any]:
    return {
        "id": record.id,
        "object": "batch",
        "endpoint": record.endpoint,
        "model": record.model,
        "errors": {"object": "list", "data": record.errors} if record.errors else None,
        "input_file_id": record.input_file_id,
        "completion_window": record.completion_window,
        "status": record.status,
        "output_file_id": record.output_file_id,
        "error_file_id": record.error_file_id,
        "created_at": record.created_at,
        "in_progress_at": record.in_progress_at,
        "expires_at": record.expires_at,
        "finalizing_at": record.finalizing_at,
        "completed_at": record.completed_at,
        "failed_at": record.failed_at,
        "expired_at": record.expired_at,
        "cancelling_at": record.cancelling_at,
        "cancelled_at": record.cancelled_at,
        "request_counts": {"total": record.total, "completed": record.completed, "failed": record.failed},
        "metadata": record.metadata,
    }
