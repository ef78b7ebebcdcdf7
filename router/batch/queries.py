"""The store's queries, each written once for SQLite and PostgreSQL: `Queries`, the part of
`SqliteStore` (sqlite.py) and `PostgresStore` (postgres.py) that is the same SQL.

What the two keep in their own ways, each store writes itself: connections and transactions,
how a file's content is kept (a blob; rows of chunks), how a batch's lines go in (one insert per
line; COPY), and how the lines are read back as a batch's files are written.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any, Generic, Protocol, TypeVar

from router.batch.schema import FILE_COLUMNS, Dialect
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

# The bytes the store keeps, as `max_storage_bytes` counts them: every file (inputs, and the output
# and error files a batch ends with), and each unfinished batch's copy of its lines (custom_id,
# url, body) with the results recorded so far; a finished batch's lines are deleted as its files
# are written. Rows' overhead and indexes are not counted. The lines are read at every upload.
_USED = "SELECT (SELECT COALESCE(SUM(bytes), 0) FROM {files}) + (SELECT COALESCE(SUM({line_bytes}), 0) FROM {lines})"
_RUNNING = ("in_progress", "cancelling")  # a line of a batch in these may still be recorded


class Cursor(Protocol):
    @property
    def rowcount(self) -> int: ...
    def fetchone(self) -> Any: ...
    def fetchall(self) -> list[Any]: ...


class Connection(Protocol):
    def execute(self, sql: str, params: Mapping[str, Any], /) -> Cursor: ...


class Output(Protocol):
    """A batch's output or error file as `finish` writes it."""

    def write(self, data: bytes) -> None: ...
    def close(self) -> int:
        """Keep the file if anything was written (its size), else leave no trace of it (0)."""
        ...


Db = TypeVar("Db", bound=Connection)


class Queries(Generic[Db]):
    """Every query both stores run. A store gives its dialect, its clock, transactions and
    reads, and the few steps it takes its own way (the `_` methods below that raise)."""

    dialect: Dialect

    def __init__(self, *, clock: Callable[[], float]) -> None:
        self._clock = clock

    # What each store does its own way.

    def _tx(self) -> AbstractContextManager[Db]:
        """One transaction, committed at the end, rolled back on an error."""
        raise NotImplementedError

    def _rows(self, sql: str, args: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        """The rows of one read."""
        raise NotImplementedError

    def _many(self, db: Db, sql: str, rows: list[dict[str, Any]]) -> None:
        """`sql` once for each of `rows`."""
        raise NotImplementedError

    def _insert_lines(self, db: Db, batch_id: str, lines: Iterable[tuple[str, str, str]]) -> None:
        raise NotImplementedError

    def _each(self, db: Db, sql: str, args: Mapping[str, Any]) -> Iterator[tuple[Any, ...]]:
        """The rows of a read that may be long, as they come (not all in memory)."""
        raise NotImplementedError

    def _output(self, db: Db, record: FileRecord) -> Output:
        raise NotImplementedError

    # Helpers.

    def _read(self, template: str, **args: Any) -> list[tuple[Any, ...]]:
        return self._rows(self.dialect.sql(template), args)

    def _run(self, db: Db, template: str, **args: Any) -> Cursor:
        return db.execute(self.dialect.sql(template), args)

    def _used(self, db: Db) -> int:
        """What the store holds, this transaction's writes included, to check a limit against."""
        return int(self._run(db, _USED).fetchone()[0])

    # Files.

    def used_bytes(self) -> int:
        """What `max_storage_bytes` bounds, by every router on the store: see `_USED`."""
        return int(self._read(_USED)[0][0])

    def get_file(self, owner: str, file_id: str) -> FileRecord | None:
        rows = self._read(
            f"SELECT {FILE_COLUMNS} FROM {{files}} WHERE id = :id AND owner = :owner", id=file_id, owner=owner
        )
        return FileRecord(*rows[0]) if rows else None

    def list_files(
        self, owner: str, *, purpose: str | None, after: str | None, limit: int, newest_first: bool
    ) -> tuple[list[FileRecord], bool]:
        order, compare = ("DESC", "<") if newest_first else ("ASC", ">")
        sql = f"SELECT {FILE_COLUMNS} FROM {{files}} WHERE owner = :owner"
        if purpose is not None:
            sql += " AND purpose = :purpose"
        if after is not None:
            sql += f" AND seq {compare} COALESCE((SELECT seq FROM {{files}} WHERE id = :after AND owner = :owner), -1)"
        rows = self._read(
            f"{sql} ORDER BY seq {order} LIMIT :limit", owner=owner, purpose=purpose, after=after, limit=limit + 1
        )
        return [FileRecord(*row) for row in rows[:limit]], len(rows) > limit

    def delete_file(self, owner: str, file_id: str) -> bool:
        with self._tx() as db:
            deleted = self._run(db, "DELETE FROM {files} WHERE id = :id AND owner = :owner", id=file_id, owner=owner)
            return deleted.rowcount > 0

    # Batches.

    def create_batch(self, record: BatchRecord, lines: Iterable[tuple[str, str, str]], *, limit: int) -> None:
        """The batch and its lines `(custom_id, url, body)`, in one transaction; StorageFull, and
        nothing kept, if their copy takes the store past `limit` bytes. `lines` is taken one at a
        time: it may read them from a file as they go in."""
        names = [name.strip() for name in BATCH_COLUMNS.split(",")]
        marks = ", ".join(f":{name}" for name in names)
        with self._tx() as db:
            self._run(
                db,
                f"INSERT INTO {{batches}} ({BATCH_COLUMNS}) VALUES ({marks})",
                **dict(zip(names, batch_values(record), strict=True)),
            )
            self._insert_lines(db, record.id, lines)
            used = self._used(db)
            if used > limit:
                raise StorageFull(f"with them the batch store would hold {used} of its {limit} bytes")

    def get_batch(self, owner: str, batch_id: str) -> BatchRecord | None:
        rows = self._read(
            f"SELECT {BATCH_COLUMNS} FROM {{batches}} WHERE id = :id AND owner = :owner", id=batch_id, owner=owner
        )
        return batch_record(rows[0]) if rows else None

    def list_batches(self, owner: str, *, after: str | None, limit: int) -> tuple[list[BatchRecord], bool]:
        """Newest first; `after` is the last id of the previous page."""
        sql = f"SELECT {BATCH_COLUMNS} FROM {{batches}} WHERE owner = :owner"
        if after is not None:
            sql += " AND seq < COALESCE((SELECT seq FROM {batches} WHERE id = :after AND owner = :owner), -1)"
        rows = self._read(f"{sql} ORDER BY seq DESC LIMIT :limit", owner=owner, after=after, limit=limit + 1)
        return [batch_record(row) for row in rows[:limit]], len(rows) > limit

    def cancel(self, owner: str, batch_id: str, now: int) -> BatchRecord | None:
        with self._tx() as db:
            self._run(
                db,
                "UPDATE {batches} SET status = 'cancelling', cancelling_at = :at"
                " WHERE id = :id AND owner = :owner AND status IN ('validating', 'in_progress')",
                at=now,
                id=batch_id,
                owner=owner,
            )
        return self.get_batch(owner, batch_id)

    def active(self) -> list[BatchRecord]:
        among, statuses = _among("status", ACTIVE)
        rows = self._read(f"SELECT {BATCH_COLUMNS} FROM {{batches}} WHERE status IN ({among}) ORDER BY seq", **statuses)
        return [batch_record(row) for row in rows]

    def set_status(self, batch_id: str, status: BatchStatus, now: int, *, before: tuple[BatchStatus, ...]) -> None:
        """Move a batch to `status` (stamping `<status>_at`) if it is in one of `before`."""
        among, statuses = _among("before", before)
        with self._tx() as db:
            self._run(
                db,
                f"UPDATE {{batches}} SET status = :status, {status}_at = :at WHERE id = :id AND status IN ({among})",
                status=status,
                at=now,
                id=batch_id,
                **statuses,
            )

    def count_by_status(self) -> dict[str, int]:
        return {
            status: int(count) for status, count in self._read("SELECT status, COUNT(*) FROM {batches} GROUP BY status")
        }

    # Lines.

    def claim(self, batch_id: str, owner: str, n: int, *, now: float, until: float) -> list[Line]:
        """Take up to `n` pending lines nobody holds (in file order), leased to `owner` for
        `until - now` seconds."""
        with self._tx() as db:
            rows = self._run(
                db,
                "WITH picked AS ("
                " SELECT batch_id AS b, idx AS i FROM {lines}"
                " WHERE batch_id = :batch_id AND done = FALSE AND lease_until <= {now}"
                " ORDER BY idx LIMIT :n{skip_locked}"
                ") UPDATE {lines} SET lease_owner = :owner, lease_until = {now} + :lease"
                " FROM picked WHERE {lines}.batch_id = picked.b AND {lines}.idx = picked.i"
                " RETURNING batch_id, idx, custom_id, url, body, attempts",
                batch_id=batch_id,
                n=n,
                owner=owner,
                now=now,
                lease=until - now,
            ).fetchall()
        return sorted((Line(*row) for row in rows), key=lambda line: line.idx)

    def renew(self, owner: str, lines: list[tuple[str, int]], until: float) -> None:
        """Extend `owner`'s leases on `lines` (batch id, index) that are still pending."""
        if not lines:
            return
        now = self._clock()
        sql = self.dialect.sql(
            "UPDATE {lines} SET lease_until = {now} + :lease"
            " WHERE batch_id = :batch_id AND idx = :idx AND lease_owner = :owner AND done = FALSE"
        )
        rows = [{"now": now, "lease": until - now, "batch_id": b, "idx": i, "owner": owner} for b, i in lines]
        with self._tx() as db:
            self._many(db, sql, rows)

    def record(self, line: Line, result: dict[str, Any], *, failed: bool) -> bool:
        """Store a line's result and count it, if it was still pending and its batch still running;
        returns whether it was recorded (False: it had been answered already)."""
        with self._tx() as db:
            # The batch's row first (as `finish` takes it): records of one batch take turns.
            found = self._run(
                db, "SELECT status FROM {batches} WHERE id = :id{lock_batch}", id=line.batch_id
            ).fetchone()
            if found is None or found[0] not in _RUNNING:
                return False
            updated = self._run(
                db,
                "UPDATE {lines} SET done = TRUE, failed = :failed, result = :result, lease_owner = NULL"
                " WHERE batch_id = :batch_id AND idx = :idx AND done = FALSE",
                failed=failed,
                result=json.dumps(result, separators=(",", ":")),
                batch_id=line.batch_id,
                idx=line.idx,
            ).rowcount
            if updated:
                column = "failed" if failed else "completed"
                self._run(db, f"UPDATE {{batches}} SET {column} = {column} + 1 WHERE id = :id", id=line.batch_id)
        return updated > 0

    def retry_later(self, line: Line, not_before: float) -> None:
        now = self._clock()
        with self._tx() as db:
            self._run(
                db,
                "UPDATE {lines} SET lease_owner = NULL, lease_until = {now} + :delay, attempts = attempts + 1"
                " WHERE batch_id = :batch_id AND idx = :idx AND done = FALSE",
                now=now,
                delay=not_before - now,
                batch_id=line.batch_id,
                idx=line.idx,
            )

    def release(self, owner: str) -> None:
        """Give back every line `owner` holds and has not answered (at a graceful stop)."""
        with self._tx() as db:
            self._run(
                db,
                "UPDATE {lines} SET lease_owner = NULL, lease_until = 0 WHERE lease_owner = :owner AND done = FALSE",
                owner=owner,
            )

    def pending(self, batch_id: str) -> int:
        return int(self._read("SELECT COUNT(*) FROM {lines} WHERE batch_id = :id AND done = FALSE", id=batch_id)[0][0])

    def finish(self, batch_id: str, status: BatchStatus, now: int, *, output_id: str, error_id: str) -> None:
        """Write the output and error files from the recorded lines and end the batch, in one
        transaction, the lines read and written a few at a time. Lines never answered go to the
        error file (`batch_expired` or `batch_cancelled`)."""
        with self._tx() as db:
            found = self._run(
                db, "SELECT owner, status FROM {batches} WHERE id = :id{lock_batch}", id=batch_id
            ).fetchone()
            if found is None or found[1] not in ACTIVE:
                return  # finished already (by another router, or before a crash)
            owner = found[0]
            ids = {"output": output_id, "error": error_id}
            outputs = {
                kind: self._output(db, FileRecord(file_id, owner, f"{batch_id}_{kind}.jsonl", "batch_output", 0, now))
                for kind, file_id in ids.items()
            }
            unanswered = 0
            lines = self.dialect.sql(
                "SELECT custom_id, done, failed, result FROM {lines} WHERE batch_id = :id ORDER BY idx"
            )
            for custom_id, done, failed, result in self._each(db, lines, {"id": batch_id}):
                if not done:
                    unanswered += 1
                    result = unanswered_line(custom_id, status)
                outputs["error" if failed or not done else "output"].write(result.encode() + b"\n")
            kept = {kind: ids[kind] if output.close() else None for kind, output in outputs.items()}
            # Expired lines count as failed requests; cancelled ones were never asked for.
            self._run(
                db,
                f"UPDATE {{batches}} SET status = :status, {status}_at = :at, output_file_id = :output,"
                " error_file_id = :error, failed = failed + :unanswered WHERE id = :id",
                status=status,
                at=now,
                output=kept["output"],
                error=kept["error"],
                unanswered=unanswered if status == "expired" else 0,
                id=batch_id,
            )
            self._run(db, "DELETE FROM {lines} WHERE batch_id = :id", id=batch_id)


def _among(name: str, values: tuple[str, ...]) -> tuple[str, dict[str, str]]:
    """`IN (...)` for `values`: its parameters' marks and the parameters."""
    args = {f"{name}{i}": value for i, value in enumerate(values)}
    return ", ".join(f":{key}" for key in args), args
