"""The Batch API's store on PostgreSQL, for router replicas that share one database.

It keeps the SQLite store's promises (store.py, sqlite.py), across hosts, with the same queries
(`Queries`, queries.py, in PostgreSQL's words); written here are the connections, the tables,
files as rows of chunks, and lines put in with COPY:

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

import logging
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import ConnectionPool

from router.batch.queries import Queries
from router.batch.schema import FILE_COLUMNS, POSTGRES, TABLES
from router.batch.store import FileRecord, StorageFull
from router.errors import NoBackendAvailable

_Connection = psycopg.Connection[tuple[Any, ...]]

logger = logging.getLogger("specroute.batch")

_CHUNK = 1024 * 1024  # a file's row holds this much of it
# Advisory lock keys: one router at a time creates the tables, or counts the storage used.
_SCHEMA_LOCK = 0x5350_4543_0001
_STORAGE_LOCK = 0x5350_4543_0002

# Beside the tables of queries.py: files' content, and the indexes the lines and batches are read by.
_SCHEMA = """
CREATE TABLE IF NOT EXISTS specroute_file_chunks (
    file_id TEXT NOT NULL REFERENCES specroute_files (id) ON DELETE CASCADE,
    n INTEGER NOT NULL,
    data BYTEA NOT NULL,
    PRIMARY KEY (file_id, n)
);
CREATE INDEX IF NOT EXISTS specroute_batches_active ON specroute_batches (status, seq);
CREATE INDEX IF NOT EXISTS specroute_lines_pending ON specroute_lines (batch_id, idx) WHERE NOT done
"""


class PostgresStore(Queries[_Connection]):
    """The store in one PostgreSQL database (tables `specroute_*`), created if missing."""

    dialect = POSTGRES

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
        super().__init__(clock=clock)
        self._spool = Path(spool_dir)
        self._spool.mkdir(parents=True, exist_ok=True)
        # The tables first, on a connection of its own: a database out of reach fails here at
        # once, rather than after the pool's retries.
        try:
            with _translated(), psycopg.connect(dsn) as db:
                db.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
                for statement in (*self.dialect.sql(TABLES).split(";"), *_SCHEMA.split(";")):
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
    def _tx(self) -> Iterator[_Connection]:
        """One transaction on a pooled connection: committed at the end, rolled back on an error."""
        with _translated(), self._pool.connection() as db:
            yield db

    def _rows(self, sql: str, args: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        with self._tx() as db:
            return db.execute(sql, args).fetchall()

    def _many(self, db: _Connection, sql: str, rows: list[dict[str, Any]]) -> None:
        with db.cursor() as cursor:
            cursor.executemany(sql, rows)

    def _insert_lines(self, db: _Connection, batch_id: str, lines: Iterable[tuple[str, str, str]]) -> None:
        """Streamed in with COPY as `lines` yields them."""
        copy_lines = "COPY specroute_lines (batch_id, idx, custom_id, url, body) FROM STDIN"
        with db.cursor() as cursor, cursor.copy(copy_lines) as copy:
            for idx, line in enumerate(lines):
                copy.write_row((batch_id, idx, *line))

    def _each(self, db: _Connection, sql: str, args: Mapping[str, Any]) -> Iterator[tuple[Any, ...]]:
        with db.cursor(name="each") as rows:  # server side: the rows are read as they are used
            rows.itersize = 512
            rows.execute(sql, args)
            yield from rows

    def _used(self, db: _Connection) -> int:
        """Counted under a lock held until the commit: two routers storing at once (a file, a
        batch's lines) cannot both pass the limit."""
        db.execute("SELECT pg_advisory_xact_lock(%s)", (_STORAGE_LOCK,))
        return super()._used(db)

    def _output(self, db: _Connection, record: FileRecord) -> _Chunks:
        return _Chunks(db, record)

    def close(self) -> None:
        self._pool.close()

    # Files.

    def temporary_file(self) -> IO[bytes]:
        """An unnamed local file for an upload on its way in (gone when closed, or when the
        process dies): it is checked there before a byte of it reaches the database."""
        return tempfile.TemporaryFile(dir=self._spool)

    def add_file(self, record: FileRecord, content: IO[bytes], *, limit: int) -> None:
        """Store `record` with `content` (`record.bytes` of it, from the start), a chunk at a time."""
        with self._tx() as db:
            content.seek(0)
            chunks = _Chunks(db, record)
            while chunk := content.read(min(_CHUNK, record.bytes - chunks.size)):
                chunks.write(chunk)
            chunks.close()
            used = self._used(db)  # counted last, this file included
            if used > limit:
                raise StorageFull(f"the batch store holds {used - record.bytes} of its {limit} bytes")

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


class _Chunks:
    """A file going into `specroute_files`, its content into `specroute_file_chunks` one full
    chunk at a time."""

    def __init__(self, db: _Connection, record: FileRecord) -> None:
        self._db = db
        self._record = record
        self._buffer = bytearray()
        self._count = 0
        self.size = 0
        db.execute(
            f"INSERT INTO specroute_files ({FILE_COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s)",
            (record.id, record.owner, record.filename, record.purpose, record.bytes, record.created_at),
        )

    def write(self, data: bytes) -> None:
        self._buffer += data
        self.size += len(data)
        while len(self._buffer) >= _CHUNK:
            self._flush(bytes(self._buffer[:_CHUNK]))
            del self._buffer[:_CHUNK]

    def close(self) -> int:
        """The rest written; the file's size set to what was written, or, nothing written, the
        file gone."""
        if self._buffer:
            self._flush(bytes(self._buffer))
            self._buffer.clear()
        if not self.size:
            self._db.execute("DELETE FROM specroute_files WHERE id = %s", (self._record.id,))
        elif self.size != self._record.bytes:
            self._db.execute("UPDATE specroute_files SET bytes = %s WHERE id = %s", (self.size, self._record.id))
        return self.size

    def _flush(self, chunk: bytes) -> None:
        self._db.execute(
            "INSERT INTO specroute_file_chunks (file_id, n, data) VALUES (%s, %s, %s)",
            (self._record.id, self._count, chunk),
        )
        self._count += 1


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
