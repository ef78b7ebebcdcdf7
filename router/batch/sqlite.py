"""The Batch API's store in one SQLite database (WAL mode, every commit synced): the default, for
one router, or several on one host sharing the file.

Its queries are `Queries` (queries.py), in SQLite's words; written here are the connection, its
transactions, and a file's content kept as a blob, written and read a chunk at a time. Every
method blocks: call it from a worker thread (`anyio.to_thread.run_sync`).
"""

from __future__ import annotations

import dataclasses
import sqlite3
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from router.batch.queries import Queries
from router.batch.schema import FILE_COLUMNS, SQLITE, TABLES
from router.batch.store import FileRecord, StorageFull

# The index the lines are taken by.
_INDEXES = "CREATE INDEX IF NOT EXISTS lines_pending ON lines (batch_id, done, lease_until)"

_CHUNK = 1024 * 1024  # files go into and out of the database this much at a time


class SqliteStore(Queries[sqlite3.Connection]):
    """One SQLite database file in `directory`. Leases are timed by `clock` (the runner's)."""

    dialect = SQLITE

    def __init__(self, directory: str | Path, *, clock: Callable[[], float]) -> None:
        super().__init__(clock=clock)
        if sqlite3.sqlite_version_info < (3, 35):
            raise RuntimeError(f"the batch store needs SQLite 3.35 or later (RETURNING), not {sqlite3.sqlite_version}")
        self.path = self.file(directory)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # One connection, used by one worker thread at a time; transactions are explicit.
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=30)
        self._lock = threading.Lock()
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        for statement in (*self.dialect.sql(TABLES).split(";"), _INDEXES):
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

    def _rows(self, sql: str, args: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def _many(self, db: sqlite3.Connection, sql: str, rows: list[dict[str, Any]]) -> None:
        db.executemany(sql, rows)

    def _insert_lines(self, db: sqlite3.Connection, batch_id: str, lines: Iterable[tuple[str, str, str]]) -> None:
        db.executemany(
            "INSERT INTO lines (batch_id, idx, custom_id, url, body) VALUES (?, ?, ?, ?, ?)",
            ((batch_id, idx, *line) for idx, line in enumerate(lines)),
        )

    def _each(self, db: sqlite3.Connection, sql: str, args: Mapping[str, Any]) -> Iterator[tuple[Any, ...]]:
        return iter(db.execute(sql, args))  # a cursor steps through the rows as it is read

    def _output(self, db: sqlite3.Connection, record: FileRecord) -> _Output:
        return _Output(self, db, record)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # Files.

    def temporary_file(self) -> IO[bytes]:
        """An unnamed file in the store's directory, for an upload on its way in: on the store's
        disk rather than a /tmp that may be memory, and gone when closed, or when the process dies
        (Linux's O_TMPFILE; elsewhere its name is removed as it is made): nothing is left to clean up."""
        return tempfile.TemporaryFile(dir=self.path.parent)

    def add_file(self, record: FileRecord, content: IO[bytes], *, limit: int) -> None:
        """Store `record` with `content` (`record.bytes` of it, from the start), a chunk at a time."""
        with self._tx() as db:
            used = self._used(db)
            if used + record.bytes > limit:
                raise StorageFull(f"the batch store holds {used} of its {limit} bytes")
            self._put_file(db, record, content)

    @staticmethod
    def _put_file(db: sqlite3.Connection, record: FileRecord, content: IO[bytes]) -> None:
        rowid = db.execute(
            f"INSERT INTO files ({FILE_COLUMNS}, content) VALUES (?, ?, ?, ?, ?, ?, zeroblob(?))",
            (record.id, record.owner, record.filename, record.purpose, record.bytes, record.created_at, record.bytes),
        ).lastrowid
        assert rowid is not None
        content.seek(0)
        with db.blobopen("files", "content", rowid) as blob:
            while chunk := content.read(min(_CHUNK, record.bytes - blob.tell())):
                blob.write(chunk)

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
                    while chunk := blob.read(_CHUNK):
                        out.write(chunk)
                return True
            finally:
                self._db.execute("COMMIT")


class _Output:
    """A batch's output or error file: gathered in a temporary file beside the database (a blob
    is made at its full size), then kept as any file is."""

    def __init__(self, store: SqliteStore, db: sqlite3.Connection, record: FileRecord) -> None:
        self._db = db
        self._record = record
        self._spool = store.temporary_file()

    def write(self, data: bytes) -> None:
        self._spool.write(data)

    def close(self) -> int:
        with self._spool:
            size = self._spool.tell()
            if size:
                SqliteStore._put_file(self._db, dataclasses.replace(self._record, bytes=size), self._spool)
        return size
