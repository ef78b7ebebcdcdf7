"""The tables both Batch API stores keep, and `Dialect`: the words SQLite and PostgreSQL say
differently in the queries written once for both (queries.py).

A query is one text with named parameters (`:name`) and the few words the two databases say
differently, which its store's `Dialect` fills in:

- the parameters: `:name` for sqlite3, `%(name)s` for psycopg;
- the tables' names (PostgreSQL's carry a `specroute_` prefix: they share a database);
- the clock a lease is timed by: the router's on SQLite (given as `:now`; every router on the
  file is on one host), the database's own on PostgreSQL, so routers whose clocks disagree still
  agree on a lease (a time a router gives is read as a delay from its own clock);
- the row locks PostgreSQL needs and SQLite, one writer at a time, does not: lines taken with
  `FOR UPDATE SKIP LOCKED`, a batch's row locked before a line of it is recorded or it is finished.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

FILE_COLUMNS = "id, owner, filename, purpose, bytes, created_at"

# The tables both stores keep, in types both databases take: SQLite reads BIGINT, BOOLEAN and
# DOUBLE PRECISION, by its affinity rules, as INTEGER, NUMERIC and REAL.
TABLES = """
CREATE TABLE IF NOT EXISTS {files} (
    seq {serial},
    id TEXT NOT NULL UNIQUE,
    owner TEXT NOT NULL,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    bytes BIGINT NOT NULL,
    created_at BIGINT NOT NULL{file_content}
);
CREATE TABLE IF NOT EXISTS {batches} (
    seq {serial},
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
CREATE TABLE IF NOT EXISTS {lines} (
    batch_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    custom_id TEXT NOT NULL,
    url TEXT NOT NULL,
    body TEXT NOT NULL,
    done BOOLEAN NOT NULL DEFAULT FALSE,
    failed BOOLEAN NOT NULL DEFAULT FALSE,
    result TEXT,
    attempts INTEGER NOT NULL DEFAULT 0,
    lease_owner TEXT,
    lease_until DOUBLE PRECISION NOT NULL DEFAULT 0,
    PRIMARY KEY (batch_id, idx)
)
"""


@dataclass(frozen=True, slots=True)
class Dialect:
    paramstyle: Literal["named", "pyformat"]  # :name (sqlite3), %(name)s (psycopg)
    tables: str  # the prefix of the tables' names
    serial: str  # a table's own sequence, its key
    file_content: str  # after a file's columns: the content, where it is kept in the file's row
    now: str  # the time leases are read against
    skip_locked: str  # after the SELECT of the lines to take: pass over those being taken
    lock_batch: str  # after the SELECT of a batch's row about to change: hold it to the end
    octets: str  # the bytes of a text value `{}` (not its characters)

    def sql(self, template: str) -> str:
        """`template` in this dialect's words (a few microseconds: not worth keeping)."""
        text = template.format(
            files=f"{self.tables}files",
            batches=f"{self.tables}batches",
            lines=f"{self.tables}lines",
            now=self.now,
            skip_locked=self.skip_locked,
            lock_batch=self.lock_batch,
            serial=self.serial,
            file_content=self.file_content,
            line_bytes=" + ".join(
                self.octets.format(column) for column in ("custom_id", "url", "body", "COALESCE(result, '')")
            ),
        )
        return re.sub(r":(\w+)", r"%(\1)s", text) if self.paramstyle == "pyformat" else text


SQLITE = Dialect(
    paramstyle="named",
    tables="",
    serial="INTEGER PRIMARY KEY AUTOINCREMENT",
    file_content=",\n    content BLOB NOT NULL",
    now=":now",
    skip_locked="",
    lock_batch="",
    octets="length(CAST({} AS BLOB))",
)
POSTGRES = Dialect(
    paramstyle="pyformat",
    tables="specroute_",
    serial="BIGSERIAL PRIMARY KEY",
    file_content="",  # rows of chunks: specroute_file_chunks
    now="extract(epoch FROM clock_timestamp())",
    skip_locked=" FOR UPDATE SKIP LOCKED",
    lock_batch=" FOR NO KEY UPDATE",
    octets="octet_length({})",
)
