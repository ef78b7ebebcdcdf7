"""Where files, batches and every line's result are kept: the records, and `Store`, what the
Batch API needs of a store. `SqliteStore` (sqlite.py) is the embedded one, `PostgresStore`
(postgres.py) the one replicas on several hosts share; both run the same queries (queries.py).

Both keep these promises. A line is recorded done in the same transaction that stores its result
and counts it, and only if it was still pending: whatever runs it twice (a router restarted
after a crash, two routers on one store), it is answered once in the output. Lines are taken
under a lease (owner, until), so two routers on one store do not start the same line while its
lease holds, and the lines of a router that died are taken again once their lease runs out.
Every method blocks: call it from a worker thread (`anyio.to_thread.run_sync`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import IO, Any, Literal, Protocol

BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]
# Batches the runner still has work for.
ACTIVE: tuple[BatchStatus, ...] = ("validating", "in_progress", "finalizing", "cancelling")
STATUSES: tuple[BatchStatus, ...] = (
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
)

BATCH_COLUMNS = (
    "id, owner, status, endpoint, input_file_id, completion_window, model, metadata, errors, created_at, "
    "expires_at, in_progress_at, finalizing_at, completed_at, failed_at, expired_at, cancelling_at, "
    "cancelled_at, output_file_id, error_file_id, total, completed, failed"
)


@dataclass(frozen=True, slots=True)
class FileRecord:
    id: str
    owner: str
    filename: str
    purpose: str
    bytes: int
    created_at: int


@dataclass(frozen=True, slots=True)
class BatchRecord:
    id: str
    owner: str
    status: BatchStatus
    endpoint: str
    input_file_id: str
    completion_window: str
    model: str | None
    metadata: dict[str, str] | None
    errors: list[dict[str, Any]] | None
    created_at: int
    expires_at: int
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    total: int = 0
    completed: int = 0
    failed: int = 0


@dataclass(frozen=True, slots=True)
class Line:
    """One request of a batch, as the runner takes it."""

    batch_id: str
    idx: int  # 0-based position in the input file
    custom_id: str
    url: str
    body: str  # the request body, JSON
    attempts: int = 0


class StorageFull(Exception):
    """Storing this would take the store past its limit."""


class Store(Protocol):
    """What the Batch API needs of a store."""

    def temporary_file(self) -> IO[bytes]: ...
    def used_bytes(self) -> int: ...
    def add_file(self, record: FileRecord, content: IO[bytes], *, limit: int) -> None: ...
    def get_file(self, owner: str, file_id: str) -> FileRecord | None: ...
    def copy_file(self, owner: str, file_id: str, out: IO[bytes]) -> bool: ...
    def list_files(
        self, owner: str, *, purpose: str | None, after: str | None, limit: int, newest_first: bool
    ) -> tuple[list[FileRecord], bool]: ...
    def delete_file(self, owner: str, file_id: str) -> bool: ...
    def create_batch(self, record: BatchRecord, lines: Iterable[tuple[str, str, str]], *, limit: int) -> None: ...
    def get_batch(self, owner: str, batch_id: str) -> BatchRecord | None: ...
    def list_batches(self, owner: str, *, after: str | None, limit: int) -> tuple[list[BatchRecord], bool]: ...
    def cancel(self, owner: str, batch_id: str, now: int) -> BatchRecord | None: ...
    def active(self) -> list[BatchRecord]: ...
    def set_status(self, batch_id: str, status: BatchStatus, now: int, *, before: tuple[BatchStatus, ...]) -> None: ...
    def claim(self, batch_id: str, owner: str, n: int, *, now: float, until: float) -> list[Line]: ...
    def renew(self, owner: str, lines: list[tuple[str, int]], until: float) -> None: ...
    def record(self, line: Line, result: dict[str, Any], *, failed: bool) -> bool: ...
    def retry_later(self, line: Line, not_before: float) -> None: ...
    def release(self, owner: str) -> None: ...
    def pending(self, batch_id: str) -> int: ...
    def finish(self, batch_id: str, status: BatchStatus, now: int, *, output_id: str, error_id: str) -> None: ...
    def count_by_status(self) -> dict[str, int]: ...
    def close(self) -> None: ...


def unanswered_line(custom_id: str, status: BatchStatus) -> str:
    """The error file's line for a request never run: the batch expired or was cancelled first."""
    code, message = "batch_cancelled", "This request was not executed because the batch was cancelled."
    if status == "expired":
        code, message = "batch_expired", "This request could not be executed before the completion window expired."
    error = {"code": code, "message": message}
    line = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None, "error": error}
    return json.dumps(line, separators=(",", ":"))


def batch_values(record: BatchRecord) -> tuple[Any, ...]:
    """The record as a row of `BATCH_COLUMNS`."""
    return (
        record.id,
        record.owner,
        record.status,
        record.endpoint,
        record.input_file_id,
        record.completion_window,
        record.model,
        json.dumps(record.metadata) if record.metadata is not None else None,
        json.dumps(record.errors) if record.errors is not None else None,
        record.created_at,
        record.expires_at,
        record.in_progress_at,
        record.finalizing_at,
        record.completed_at,
        record.failed_at,
        record.expired_at,
        record.cancelling_at,
        record.cancelled_at,
        record.output_file_id,
        record.error_file_id,
        record.total,
        record.completed,
        record.failed,
    )


def batch_record(row: tuple[Any, ...]) -> BatchRecord:
    values = list(row)
    values[7] = json.loads(values[7]) if values[7] is not None else None
    values[8] = json.loads(values[8]) if values[8] is not None else None
    return BatchRecord(*values)
