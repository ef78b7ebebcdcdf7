"""Where files, batches and every line's result are kept: `Store`, and its SQLite implementation.

A line is recorded done in the same transaction that stores its result and counts it, and only
if it was still pending: whatever runs it twice (a router restarted after a crash, two routers
on one store), it is answered once in the output. Lines are taken under a lease (owner, until),
so two routers on one database file do not start the same line while its lease holds, and the
lines of a router that died are taken again once their lease runs out.

For replicas on several hosts, `PostgresStore` (postgres.py) keeps the same promises on a
database server. Every method blocks: call it from a worker thread (`anyio.to_thread.run_sync`).
"""

from __future__ import annotations

import json
import sqlite3
import tempfile
import threading
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
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

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    owner TEXT NOT NULL,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    content BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    owner TEXT NOT NULL,
    status TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    model TEXT,
    metadata TEXT,
    errors TEXT,
    created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    in_progress_at INTEGER,
    finalizing_at INTEGER,
    completed_at INTEGER,
    failed_at INTEGER,
    expired_at INTEGER,
    cancelling_at INTEGER,
    cancelled_at INTEGER,
    output_file_id TEXT,
    error_file_id TEXT,
    total INTEGER NOT NULL,
    completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    custom_id TEXT NOT NULL,
    url TEXT NOT NULL,
    body TEXT NOT NULL,
    done INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    result TEXT,
    attempts INTEGER NOT NULL DEFAULT 0,
    lease_owner TEXT,
    lease_until REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (batch_id, idx)
);
CREATE INDEX IF NOT EXISTS lines_pending ON lines (batch_id, done, lease_until);
"""

_COPY_CHUNK = 1024 * 1024  # files go into and out of the database this much at a time

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
    """What the Batch API needs of a store: `SqliteStore` is the embedded one, `PostgresStore`
    (postgres.py) the one that replicas share."""

    def temporary_file(self) -> IO[bytes]: ...
    def used_bytes(self) -> int: ...
    def add_file(self, record: FileRecord, content: IO[bytes], *, limit: int) -> None: ...
    def get_file(self, owner: str, file_id: str) -> FileRecord | None: ...
    def copy_file(self, owner: str, file_id: str, out: IO[bytes]) -> bool: ...
    def list_files(
        self, owner: str, *, purpose: str | None, after: str | None, limit: int, newest_first: bool
    ) -> tuple[list[FileRecord], bool]: ...
    def delete_file(self, owner: str, file_id: str) -> bool: ...
    def create_batch(self, record: BatchRecord, lines: Iterable[tuple[str, str, str]]) -> None: ...
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


class SqliteStore:
    """One SQLite database in WAL mode, every commit synced (`synchronous=FULL`)."""

    def __init__(self, directory: str | Path) -> None:
        if sqlite3.sqlite_version_info < (3, 35):
            raise RuntimeError(f"the batch store needs SQLite 3.35 or later (RETURNING), not {sqlite3.sqlite_version}")
        self.path = self.file(directory)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # One connection, used by one worker thread at a time; transactions are explicit.
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=30)
        self._lock = threading.Lock()
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        for statement in _SCHEMA.split(";"):
            if statement.strip():
                self._db.execute(statement)

    @staticmethod
    def file(directory: str | Path) -> Path:
        """The database file in `directory`."""
        return Path(directory) / "batches.sqlite3"

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One transaction, holding the write lock from its start (other routers on the file wait)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _read(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # Files.

    def temporary_file(self) -> IO[bytes]:
        """An unnamed file in the store's directory, for an upload on its way in: on the store's
        disk rather than a /tmp that may be memory, and gone when closed, or when the process dies
        (Linux's O_TMPFILE; elsewhere its name is removed as it is made): nothing is left to clean up."""
        return tempfile.TemporaryFile(dir=self.path.parent)

    def used_bytes(self) -> int:
        """The bytes of every file kept (what `max_storage_bytes` bounds)."""
        return int(self._read("SELECT COALESCE(SUM(bytes), 0) FROM files")[0][0])

    def add_file(self, record: FileRecord, content: IO[bytes], *, limit: int) -> None:
        """Store `record` with `content` (`record.bytes` of it, from the start), a chunk at a time."""
        with self._tx() as db:
            (used,) = db.execute("SELECT COALESCE(SUM(bytes), 0) FROM files").fetchone()
            if used + record.bytes > limit:
                raise StorageFull(f"the batch store holds {used} of its {limit} bytes")
            rowid = db.execute(
                "INSERT INTO files (id, owner, filename, purpose, bytes, created_at, content)"
                " VALUES (?, ?, ?, ?, ?, ?, zeroblob(?))",
                (
                    record.id,
                    record.owner,
                    record.filename,
                    record.purpose,
                    record.bytes,
                    record.created_at,
                    record.bytes,
                ),
            ).lastrowid
            assert rowid is not None
            content.seek(0)
            with db.blobopen("files", "content", rowid) as blob:
                while chunk := content.read(min(_COPY_CHUNK, record.bytes - blob.tell())):
                    blob.write(chunk)

    @staticmethod
    def _insert_file(db: sqlite3.Connection, record: FileRecord, content: bytes) -> None:
        db.execute(
            "INSERT INTO files (id, owner, filename, purpose, bytes, created_at, content) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (record.id, record.owner, record.filename, record.purpose, record.bytes, record.created_at, content),
        )

    def get_file(self, owner: str, file_id: str) -> FileRecord | None:
        rows = self._read(
            "SELECT id, owner, filename, purpose, bytes, created_at FROM files WHERE id = ? AND owner = ?",
            file_id,
            owner,
        )
        return FileRecord(*rows[0]) if rows else None

    def copy_file(self, owner: str, file_id: str, out: IO[bytes]) -> bool:
        """Write the file's content to `out` a chunk at a time, as one snapshot; False if there is
        no such file."""
        with self._lock:
            self._db.execute("BEGIN")  # a read transaction: a delete meanwhile does not cut it short
            try:
                rows = self._db.execute("SELECT seq FROM files WHERE id = ? AND owner = ?", (file_id, owner)).fetchall()
                if not rows:
                    return False
                with self._db.blobopen("files", "content", rows[0][0], readonly=True) as blob:
                    while chunk := blob.read(_COPY_CHUNK):
                        out.write(chunk)
                return True
            finally:
                self._db.execute("COMMIT")

    def list_files(
        self, owner: str, *, purpose: str | None, after: str | None, limit: int, newest_first: bool
    ) -> tuple[list[FileRecord], bool]:
        order, compare = ("DESC", "<") if newest_first else ("ASC", ">")
        sql = "SELECT id, owner, filename, purpose, bytes, created_at FROM files WHERE owner = ?"
        args: list[Any] = [owner]
        if purpose is not None:
            sql += " AND purpose = ?"
            args.append(purpose)
        if after is not None:
            sql += f" AND seq {compare} COALESCE((SELECT seq FROM files WHERE id = ?), -1)"
            args.append(after)
        rows = self._read(f"{sql} ORDER BY seq {order} LIMIT ?", *args, limit + 1)
        return [FileRecord(*row) for row in rows[:limit]], len(rows) > limit

    def delete_file(self, owner: str, file_id: str) -> bool:
        with self._tx() as db:
            return db.execute("DELETE FROM files WHERE id = ? AND owner = ?", (file_id, owner)).rowcount > 0

    # Batches.

    def create_batch(self, record: BatchRecord, lines: Iterable[tuple[str, str, str]]) -> None:
        """The batch and its lines `(custom_id, url, body)`, in one transaction. `lines` is taken
        one at a time: it may read them from a file as they go in (holding the store meanwhile)."""
        with self._tx() as db:
            db.execute(
                f"INSERT INTO batches ({BATCH_COLUMNS}) VALUES ({', '.join('?' * 23)})",
                batch_values(record),
            )
            db.executemany(
                "INSERT INTO lines (batch_id, idx, custom_id, url, body) VALUES (?, ?, ?, ?, ?)",
                ((record.id, idx, *line) for idx, line in enumerate(lines)),
            )

    def get_batch(self, owner: str, batch_id: str) -> BatchRecord | None:
        rows = self._read(f"SELECT {BATCH_COLUMNS} FROM batches WHERE id = ? AND owner = ?", batch_id, owner)
        return batch_record(rows[0]) if rows else None

    def list_batches(self, owner: str, *, after: str | None, limit: int) -> tuple[list[BatchRecord], bool]:
        """Newest first; `after` is the last id of the previous page."""
        sql = f"SELECT {BATCH_COLUMNS} FROM batches WHERE owner = ?"
        args: list[Any] = [owner]
        if after is not None:
            sql += " AND seq < COALESCE((SELECT seq FROM batches WHERE id = ? AND owner = ?), -1)"
            args += [after, owner]
        rows = self._read(f"{sql} ORDER BY seq DESC LIMIT ?", *args, limit + 1)
        return [batch_record(row) for row in rows[:limit]], len(rows) > limit

    def cancel(self, owner: str, batch_id: str, now: int) -> BatchRecord | None:
        with self._tx() as db:
            db.execute(
                "UPDATE batches SET status = 'cancelling', cancelling_at = ? "
                "WHERE id = ? AND owner = ? AND status IN ('validating', 'in_progress')",
                (now, batch_id, owner),
            )
        return self.get_batch(owner, batch_id)

    def active(self) -> list[BatchRecord]:
        marks = ", ".join("?" * len(ACTIVE))
        rows = self._read(f"SELECT {BATCH_COLUMNS} FROM batches WHERE status IN ({marks}) ORDER BY seq", *ACTIVE)
        return [batch_record(row) for row in rows]

    def set_status(self, batch_id: str, status: BatchStatus, now: int, *, before: tuple[BatchStatus, ...]) -> None:
        """Move a batch to `status` (stamping `<status>_at`) if it is in one of `before`."""
        marks = ", ".join("?" * len(before))
        with self._tx() as db:
            db.execute(
                f"UPDATE batches SET status = ?, {status}_at = ? WHERE id = ? AND status IN ({marks})",
                (status, now, batch_id, *before),
            )

    # Lines.

    def claim(self, batch_id: str, owner: str, n: int, *, now: float, until: float) -> list[Line]:
        """Take up to `n` pending lines nobody holds (in file order), leased to `owner` until `until`."""
        with self._tx() as db:
            rows = db.execute(
                "UPDATE lines SET lease_owner = ?, lease_until = ? WHERE (batch_id, idx) IN ("
                " SELECT batch_id, idx FROM lines WHERE batch_id = ? AND done = 0 AND lease_until <= ?"
                " ORDER BY idx LIMIT ?"
                ") RETURNING batch_id, idx, custom_id, url, body, attempts",
                (owner, until, batch_id, now, n),
            ).fetchall()
        return sorted((Line(*row) for row in rows), key=lambda line: line.idx)

    def renew(self, owner: str, lines: list[tuple[str, int]], until: float) -> None:
        """Extend `owner`'s leases on `lines` (batch id, index) that are still pending."""
        with self._tx() as db:
            db.executemany(
                "UPDATE lines SET lease_until = ? WHERE batch_id = ? AND idx = ? AND lease_owner = ? AND done = 0",
                ((until, batch_id, idx, owner) for batch_id, idx in lines),
            )

    def record(self, line: Line, result: dict[str, Any], *, failed: bool) -> bool:
        """Store a line's result and count it, if it was still pending and its batch still running;
        returns whether it was recorded (False: it had been answered already)."""
        with self._tx() as db:
            updated = db.execute(
                "UPDATE lines SET done = 1, failed = ?, result = ?, lease_owner = NULL"
                " WHERE batch_id = ? AND idx = ? AND done = 0 AND EXISTS ("
                "  SELECT 1 FROM batches WHERE id = ? AND status IN ('in_progress', 'cancelling'))",
                (int(failed), json.dumps(result, separators=(",", ":")), line.batch_id, line.idx, line.batch_id),
            ).rowcount
            if updated:
                column = "failed" if failed else "completed"
                db.execute(f"UPDATE batches SET {column} = {column} + 1 WHERE id = ?", (line.batch_id,))
        return updated > 0

    def retry_later(self, line: Line, not_before: float) -> None:
        with self._tx() as db:
            db.execute(
                "UPDATE lines SET lease_owner = NULL, lease_until = ?, attempts = attempts + 1"
                " WHERE batch_id = ? AND idx = ? AND done = 0",
                (not_before, line.batch_id, line.idx),
            )

    def release(self, owner: str) -> None:
        """Give back every line `owner` holds and has not answered (at a graceful stop)."""
        with self._tx() as db:
            db.execute(
                "UPDATE lines SET lease_owner = NULL, lease_until = 0 WHERE lease_owner = ? AND done = 0", (owner,)
            )

    def pending(self, batch_id: str) -> int:
        rows = self._read("SELECT COUNT(*) FROM lines WHERE batch_id = ? AND done = 0", batch_id)
        return int(rows[0][0])

    def finish(self, batch_id: str, status: BatchStatus, now: int, *, output_id: str, error_id: str) -> None:
        """Write the output and error files from the recorded lines and end the batch, in one
        transaction. Lines never answered go to the error file (`batch_expired` or
        `batch_cancelled`)."""
        with self._tx() as db:
            found = db.execute("SELECT owner, status FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if found is None or found[1] not in ACTIVE:
                return  # finished already (by another router, or before a crash)
            owner = found[0]
            output: list[str] = []
            errors: list[str] = []
            unanswered = 0
            for custom_id, done, failed, result in db.execute(
                "SELECT custom_id, done, failed, result FROM lines WHERE batch_id = ? ORDER BY idx", (batch_id,)
            ):
                if done:
                    (errors if failed else output).append(result)
                    continue
                unanswered += 1
                errors.append(unanswered_line(custom_id, status))
            file_ids: dict[str, str | None] = {"output": None, "error": None}
            for kind, lines, file_id in (("output", output, output_id), ("error", errors, error_id)):
                if not lines:
                    continue
                content = ("\n".join(lines) + "\n").encode()
                record = FileRecord(file_id, owner, f"{batch_id}_{kind}.jsonl", "batch_output", len(content), now)
                self._insert_file(db, record, content)
                file_ids[kind] = file_id
            # Expired lines count as failed requests; cancelled ones were never asked for.
            failed_more = unanswered if status == "expired" else 0
            db.execute(
                f"UPDATE batches SET status = ?, {status}_at = ?, output_file_id = ?, error_file_id = ?,"
                " failed = failed + ? WHERE id = ?",
                (status, now, file_ids["output"], file_ids["error"], failed_more, batch_id),
            )
            db.execute("DELETE FROM lines WHERE batch_id = ?", (batch_id,))

    def count_by_status(self) -> dict[str, int]:
        return {status: count for status, count in self._read("SELECT status, COUNT(*) FROM batches GROUP BY status")}


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
