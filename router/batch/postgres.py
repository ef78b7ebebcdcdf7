"""The Batch API's store on PostgreSQL, for router replicas that share one database.

It keeps the SQLite store's promises (store.py), across hosts:

- A line is taken with `SELECT ... FOR UPDATE SKIP LOCKED` under a lease (owner, until): two
  routers never hold it at once, and the lines of a router that died are taken again once its
  lease has run out. Leases are timed by the database's clock, so routers whose clocks disagree
  still agree on them: a time a router gives is read as a delay from its own clock.
- A line is recorded done in the transaction that stores its result, only if it was still
  pending and its batch still running. The batch's row is locked first, so a batch being
  finished meanwhile waits for the record, or the record for it, never both.
- Files (inputs, outputs, error files) are rows of 1 MiB chunks (`bytea`), written and read a
  chunk at a time: every replica serves every file, and none holds a whole one in memory.

Driver errors are translated here, in one place: a database that cannot be reached (refused,
lost, no free connection in time) is `NoBackendAvailable`, 503 `batch_store_unavailable`.
Every method blocks on a connection from a small pool: call it from a worker thread.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import ConnectionPool

from router.batch.store import (
    ACTIVE,
    BATCH_COLUMNS,
    BatchRecord,
    BatchStatus,
    FileRecord,
    Line,
    StorageFull,
    batch_record,
    batch_values,
    unanswered_line,
)
from router.errors import NoBackendAvailable

logger = logging.getLogger("specroute.batch")

_CHUNK = 1024 * 1024  # a file's row holds this much of it
# Advisory lock keys: one router at a time creates the tables, or counts the storage used.
_SCHEMA_LOCK = 0x5350_4543_0001
_STORAGE_LOCK = 0x5350_4543_0002
_NOW = "extract(epoch FROM clock_timestamp())"  # the database's clock, in seconds

_SCHEMA = """
CREATE TABLE IF NOT EXISTS specroute_files (
    seq BIGSERIAL PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    owner TEXT NOT NULL,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    bytes BIGINT NOT NULL,
    created_at BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS specroute_file_chunks (
    file_id TEXT NOT NULL REFERENCES specroute_files (id) ON DELETE CASCADE,
    n INTEGER NOT NULL,
    data BYTEA NOT NULL,
    PRIMARY KEY (file_id, n)
);
CREATE TABLE IF NOT EXISTS specroute_batches (
    seq BIGSERIAL PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    owner TEXT NOT NULL,
    status TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    model TEXT,
    metadata TEXT,
    errors TEXT,
    created_at BIGINT NOT NULL,
    expires_at BIGINT NOT NULL,
    in_progress_at BIGINT,
    finalizing_at BIGINT,
    completed_at BIGINT,
    failed_at BIGINT,
    expired_at BIGINT,
    cancelling_at BIGINT,
    cancelled_at BIGINT,
    output_file_id TEXT,
    error_file_id TEXT,
    total INTEGER NOT NULL,
    completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS specroute_batches_active ON specroute_batches (status, seq);
CREATE TABLE IF NOT EXISTS specroute_lines (
    batch_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    custom_id TEXT NOT NULL,
    url TEXT NOT NULL,
    body TEXT NOT NULL,
    done BOOLEAN NOT NULL DEFAULT false,
    failed BOOLEAN NOT NULL DEFAULT false,
    result TEXT,
    attempts INTEGER NOT NULL DEFAULT 0,
    lease_owner TEXT,
    lease_until DOUBLE PRECISION NOT NULL DEFAULT 0,
    PRIMARY KEY (batch_id, idx)
);
CREATE INDEX IF NOT EXISTS specroute_lines_pending ON specroute_lines (batch_id, idx) WHERE NOT done;
"""

_FILE_COLUMNS = "id, owner, filename, purpose, bytes, created_at"


class PostgresStore:
    """The store in one PostgreSQL database (tables `specroute_*`), created if missing."""

    def __init__(
        self,
        dsn: str,
        *,
        spool_dir: str | Path,
        clock: Callable[[], float],
        connections: int = 8,
        timeout: float = 5.0,
    ) -> None:
        try:
            options = conninfo_to_dict(dsn)
        except psycopg.ProgrammingError:
            # Not the driver's message: it quotes the string, password and all.
            raise RuntimeError("the DSN is not a PostgreSQL connection string") from None
        # libpq waits for a connection forever unless told otherwise: a database out of reach
        # must be an answer (503) in bounded time.
        if "connect_timeout" not in options:
            dsn = make_conninfo(dsn, connect_timeout=int(timeout))
        self._spool = Path(spool_dir)
        self._spool.mkdir(parents=True, exist_ok=True)
        self._clock = clock
        # The tables first, on a connection of its own: a database out of reach fails here at
        # once, rather than after the pool's retries.
        try:
            with _translated(), psycopg.connect(dsn) as db:
                db.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        db.execute(statement)
        except psycopg.Error as exc:  # reached, but refused: no right to create tables, say
            raise RuntimeError(f"the batch store's tables could not be made: {exc}") from exc
        # A connection is checked as it is handed out, so one broken by a database restart is
        # replaced rather than failing the request that drew it.
        self._pool = ConnectionPool(
            dsn,
            min_size=1,
            max_size=connections,
            timeout=timeout,
            check=ConnectionPool.check_connection,
            name="specroute-batch",
            open=True,
        )

    @contextmanager
    def _tx(self) -> Iterator[psycopg.Connection[tuple[Any, ...]]]:
        """One transaction on a pooled connection: committed at the end, rolled back on an error."""
        with _translated(), self._pool.connection() as db:
            yield db

    def _read(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        with self._tx() as db:
            return db.execute(sql, args).fetchall()

    def close(self) -> None:
        self._pool.close()

    # Files.

    def temporary_file(self) -> IO[bytes]:
        """An unnamed local file for an upload on its way in (gone when closed, or when the
        process dies): it is checked there before a byte of it reaches the database."""
        return tempfile.TemporaryFile(dir=self._spool)

    def used_bytes(self) -> int:
        """The bytes of every file kept, by every replica (what `max_storage_bytes` bounds)."""
        return int(self._read("SELECT COALESCE(SUM(bytes), 0) FROM specroute_files")[0][0])

    def add_file(self, record: FileRecord, content: IO[bytes], *, limit: int) -> None:
        """Store `record` with `content` (`record.bytes` of it, from the start), a chunk at a time."""
        with self._tx() as db:
            db.execute(
                f"INSERT INTO specroute_files ({_FILE_COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s)",
                (record.id, record.owner, record.filename, record.purpose, record.bytes, record.created_at),
            )
            content.seek(0)
            chunks = _Chunks(db, record.id)
            while chunk := content.read(min(_CHUNK, record.bytes - chunks.size)):
                chunks.write(chunk)
            chunks.close()
            # Counted last and under a lock, this file included: two uploads at once on two
            # routers cannot both pass the limit. The lock is held only until the commit.
            db.execute("SELECT pg_advisory_xact_lock(%s)", (_STORAGE_LOCK,))
            (used,) = _one(db.execute("SELECT COALESCE(SUM(bytes), 0) FROM specroute_files"))
            if used > limit:
                raise StorageFull(f"the batch store holds {used - record.bytes} of its {limit} bytes")

    def get_file(self, owner: str, file_id: str) -> FileRecord | None:
        rows = self._read(f"SELECT {_FILE_COLUMNS} FROM specroute_files WHERE id = %s AND owner = %s", file_id, owner)
        return FileRecord(*rows[0]) if rows else None

    def copy_file(self, owner: str, file_id: str, out: IO[bytes]) -> bool:
        """Write the file's content to `out` a chunk at a time, as one snapshot; False if there is
        no such file."""
        with self._tx() as db:
            # One snapshot for both reads: a delete meanwhile does not cut the copy short.
            db.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            found = db.execute("SELECT 1 FROM specroute_files WHERE id = %s AND owner = %s", (file_id, owner))
            if found.fetchone() is None:
                return False
            with db.cursor(name="copy_file") as chunks:  # server side: a few chunks in memory at most
                chunks.itersize = 4
                chunks.execute("SELECT data FROM specroute_file_chunks WHERE file_id = %s ORDER BY n", (file_id,))
                for (data,) in chunks:
                    out.write(data)
            return True

    def list_files(
        self, owner: str, *, purpose: str | None, after: str | None, limit: int, newest_first: bool
    ) -> tuple[list[FileRecord], bool]:
        order, compare = ("DESC", "<") if newest_first else ("ASC", ">")
        sql = f"SELECT {_FILE_COLUMNS} FROM specroute_files WHERE owner = %s"
        args: list[Any] = [owner]
        if purpose is not None:
            sql += " AND purpose = %s"
            args.append(purpose)
        if after is not None:
            sql += f" AND seq {compare} COALESCE((SELECT seq FROM specroute_files WHERE id = %s), -1)"
            args.append(after)
        rows = self._read(f"{sql} ORDER BY seq {order} LIMIT %s", *args, limit + 1)
        return [FileRecord(*row) for row in rows[:limit]], len(rows) > limit

    def delete_file(self, owner: str, file_id: str) -> bool:
        with self._tx() as db:
            deleted = db.execute("DELETE FROM specroute_files WHERE id = %s AND owner = %s", (file_id, owner))
            return deleted.rowcount > 0

    # Batches.

    def create_batch(self, record: BatchRecord, lines: Iterable[tuple[str, str, str]]) -> None:
        """The batch and its lines `(custom_id, url, body)`, in one transaction; the lines are
        streamed in with COPY as `lines` yields them."""
        with self._tx() as db:
            marks = ", ".join(["%s"] * len(BATCH_COLUMNS.split(",")))
            db.execute(f"INSERT INTO specroute_batches ({BATCH_COLUMNS}) VALUES ({marks})", batch_values(record))
            copy_lines = "COPY specroute_lines (batch_id, idx, custom_id, url, body) FROM STDIN"
            with db.cursor() as cursor, cursor.copy(copy_lines) as copy:
                for idx, line in enumerate(lines):
                    copy.write_row((record.id, idx, *line))

    def get_batch(self, owner: str, batch_id: str) -> BatchRecord | None:
        rows = self._read(
            f"SELECT {BATCH_COLUMNS} FROM specroute_batches WHERE id = %s AND owner = %s", batch_id, owner
        )
        return batch_record(rows[0]) if rows else None

    def list_batches(self, owner: str, *, after: str | None, limit: int) -> tuple[list[BatchRecord], bool]:
        """Newest first; `after` is the last id of the previous page."""
        sql = f"SELECT {BATCH_COLUMNS} FROM specroute_batches WHERE owner = %s"
        args: list[Any] = [owner]
        if after is not None:
            sql += " AND seq < COALESCE((SELECT seq FROM specroute_batches WHERE id = %s AND owner = %s), -1)"
            args += [after, owner]
        rows = self._read(f"{sql} ORDER BY seq DESC LIMIT %s", *args, limit + 1)
        return [batch_record(row) for row in rows[:limit]], len(rows) > limit

    def cancel(self, owner: str, batch_id: str, now: int) -> BatchRecord | None:
        with self._tx() as db:
            db.execute(
                "UPDATE specroute_batches SET status = 'cancelling', cancelling_at = %s"
                " WHERE id = %s AND owner = %s AND status IN ('validating', 'in_progress')",
                (now, batch_id, owner),
            )
        return self.get_batch(owner, batch_id)

    def active(self) -> list[BatchRecord]:
        rows = self._read(
            f"SELECT {BATCH_COLUMNS} FROM specroute_batches WHERE status = ANY(%s) ORDER BY seq", list(ACTIVE)
        )
        return [batch_record(row) for row in rows]

    def set_status(self, batch_id: str, status: BatchStatus, now: int, *, before: tuple[BatchStatus, ...]) -> None:
        """Move a batch to `status` (stamping `<status>_at`) if it is in one of `before`."""
        with self._tx() as db:
            db.execute(
                f"UPDATE specroute_batches SET status = %s, {status}_at = %s WHERE id = %s AND status = ANY(%s)",
                (status, now, batch_id, list(before)),
            )

    # Lines.

    def claim(self, batch_id: str, owner: str, n: int, *, now: float, until: float) -> list[Line]:
        """Take up to `n` pending lines nobody holds (in file order), leased to `owner` for
        `until - now` seconds of the database's clock."""
        with self._tx() as db:
            rows = db.execute(
                "WITH picked AS ("
                " SELECT batch_id, idx FROM specroute_lines"
                f" WHERE batch_id = %s AND NOT done AND lease_until <= {_NOW}"
                " ORDER BY idx LIMIT %s FOR UPDATE SKIP LOCKED"
                f") UPDATE specroute_lines AS l SET lease_owner = %s, lease_until = {_NOW} + %s"
                " FROM picked WHERE l.batch_id = picked.batch_id AND l.idx = picked.idx"
                " RETURNING l.batch_id, l.idx, l.custom_id, l.url, l.body, l.attempts",
                (batch_id, n, owner, until - now),
            ).fetchall()
        return sorted((Line(*row) for row in rows), key=lambda line: line.idx)

    def renew(self, owner: str, lines: list[tuple[str, int]], until: float) -> None:
        """Extend `owner`'s leases on `lines` (batch id, index) that are still pending."""
        if not lines:
            return
        lease = until - self._clock()
        with self._tx() as db, db.cursor() as cursor:
            cursor.executemany(
                f"UPDATE specroute_lines SET lease_until = {_NOW} + %s"
                " WHERE batch_id = %s AND idx = %s AND lease_owner = %s AND NOT done",
                [(lease, batch_id, idx, owner) for batch_id, idx in lines],
            )

    def record(self, line: Line, result: dict[str, Any], *, failed: bool) -> bool:
        """Store a line's result and count it, if it was still pending and its batch still running;
        returns whether it was recorded (False: it had been answered already)."""
        with self._tx() as db:
            # The batch's row first (as `finish` takes it): records of one batch take turns.
            found = db.execute(
                "SELECT status FROM specroute_batches WHERE id = %s FOR NO KEY UPDATE", (line.batch_id,)
            ).fetchone()
            if found is None or found[0] not in ("in_progress", "cancelling"):
                return False
            updated = db.execute(
                "UPDATE specroute_lines SET done = true, failed = %s, result = %s, lease_owner = NULL"
                " WHERE batch_id = %s AND idx = %s AND NOT done",
                (failed, json.dumps(result, separators=(",", ":")), line.batch_id, line.idx),
            ).rowcount
            if updated:
                column = "failed" if failed else "completed"
                db.execute(f"UPDATE specroute_batches SET {column} = {column} + 1 WHERE id = %s", (line.batch_id,))
        return updated > 0

    def retry_later(self, line: Line, not_before: float) -> None:
        with self._tx() as db:
            db.execute(
                f"UPDATE specroute_lines SET lease_owner = NULL, lease_until = {_NOW} + %s, attempts = attempts + 1"
                " WHERE batch_id = %s AND idx = %s AND NOT done",
                (not_before - self._clock(), line.batch_id, line.idx),
            )

    def release(self, owner: str) -> None:
        """Give back every line `owner` holds and has not answered (at a graceful stop)."""
        with self._tx() as db:
            db.execute(
                "UPDATE specroute_lines SET lease_owner = NULL, lease_until = 0 WHERE lease_owner = %s AND NOT done",
                (owner,),
            )

    def pending(self, batch_id: str) -> int:
        (count,) = self._read("SELECT COUNT(*) FROM specroute_lines WHERE batch_id = %s AND NOT done", batch_id)[0]
        return int(count)

    def finish(self, batch_id: str, status: BatchStatus, now: int, *, output_id: str, error_id: str) -> None:
        """Write the output and error files from the recorded lines and end the batch, in one
        transaction, a chunk at a time. Lines never answered go to the error file."""
        with self._tx() as db:
            found = db.execute("SELECT owner, status FROM specroute_batches WHERE id = %s FOR UPDATE", (batch_id,))
            row = found.fetchone()
            if row is None or row[1] not in ACTIVE:
                return  # finished already (by another router, or before a crash)
            owner = row[0]
            files = {"output": output_id, "error": error_id}
            for kind, file_id in files.items():
                db.execute(
                    f"INSERT INTO specroute_files ({_FILE_COLUMNS}) VALUES (%s, %s, %s, %s, 0, %s)",
                    (file_id, owner, f"{batch_id}_{kind}.jsonl", "batch_output", now),
                )
            written = {kind: _Chunks(db, file_id) for kind, file_id in files.items()}
            unanswered = 0
            with db.cursor(name="finish") as lines:  # server side: the lines are read as they are written out
                lines.itersize = 512
                lines.execute(
                    "SELECT custom_id, done, failed, result FROM specroute_lines WHERE batch_id = %s ORDER BY idx",
                    (batch_id,),
                )
                for custom_id, done, failed, result in lines:
                    if not done:
                        unanswered += 1
                        result = unanswered_line(custom_id, status)
                    written["error" if failed or not done else "output"].write(result.encode() + b"\n")
            kept: dict[str, str | None] = {}
            for kind, chunks in written.items():
                chunks.close()
                kept[kind] = files[kind] if chunks.size else None
                if chunks.size:
                    db.execute("UPDATE specroute_files SET bytes = %s WHERE id = %s", (chunks.size, files[kind]))
                else:
                    db.execute("DELETE FROM specroute_files WHERE id = %s", (files[kind],))
            # Expired lines count as failed requests; cancelled ones were never asked for.
            failed_more = unanswered if status == "expired" else 0
            db.execute(
                f"UPDATE specroute_batches SET status = %s, {status}_at = %s, output_file_id = %s,"
                " error_file_id = %s, failed = failed + %s WHERE id = %s",
                (status, now, kept["output"], kept["error"], failed_more, batch_id),
            )
            db.execute("DELETE FROM specroute_lines WHERE batch_id = %s", (batch_id,))

    def count_by_status(self) -> dict[str, int]:
        rows = self._read("SELECT status, COUNT(*) FROM specroute_batches GROUP BY status")
        return {status: int(count) for status, count in rows}


class _Chunks:
    """A file's content going into `specroute_file_chunks`, one full chunk at a time."""

    def __init__(self, db: psycopg.Connection[tuple[Any, ...]], file_id: str) -> None:
        self._db = db
        self._file_id = file_id
        self._buffer = bytearray()
        self._count = 0
        self.size = 0

    def write(self, data: bytes) -> None:
        self._buffer += data
        self.size += len(data)
        while len(self._buffer) >= _CHUNK:
            self._flush(bytes(self._buffer[:_CHUNK]))
            del self._buffer[:_CHUNK]

    def close(self) -> None:
        if self._buffer:
            self._flush(bytes(self._buffer))
            self._buffer.clear()

    def _flush(self, chunk: bytes) -> None:
        self._db.execute(
            "INSERT INTO specroute_file_chunks (file_id, n, data) VALUES (%s, %s, %s)",
            (self._file_id, self._count, chunk),
        )
        self._count += 1


def _one(cursor: psycopg.Cursor[tuple[Any, ...]]) -> tuple[Any, ...]:
    row = cursor.fetchone()
    assert row is not None, "an aggregate has a row"
    return row


@contextmanager
def _translated() -> Iterator[None]:
    """The driver's failures to reach the database, as the router's 503 (the one place they are
    translated). The client is told no more than that; the log has the driver's reason, which
    names the server but never the password."""
    try:
        yield
    except psycopg.OperationalError as exc:  # refused, lost, shut down, or no connection free in time
        logger.warning("batch store: PostgreSQL not reachable: %s", exc)
        raise NoBackendAvailable(
            "the batch store (PostgreSQL) cannot be reached; try again later",
            retry_after=5,
            code="batch_store_unavailable",
        ) from exc
