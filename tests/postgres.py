"""A real PostgreSQL server for the tests: the distribution's binaries (Debian's `postgresql`
package), a cluster made with `initdb` in a temporary directory, listening on a free loopback
port with password (SCRAM) authentication, as a deployment would.

PostgreSQL refuses to run as root, and the tests run as root in CI: then the server runs as the
`postgres` user the package creates (the child process switches user before it starts, so the
server is our child and its signals reach it directly).
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import psycopg
import pytest

from tests.servers import free_port

USER = "specroute"
PASSWORD = "pg-test-secret-5d1c"  # tests look for it where it must never appear


def binaries() -> Path | None:
    """The newest installed server's bin directory, if any."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"), key=lambda p: int(Path(p).parent.parent.name))
    return Path(found[-1]).parent if found else None


class PostgresServer:
    """`with PostgresServer() as server:` a running server; `server.database(name)` makes a
    database and returns its DSN."""

    def __init__(self) -> None:
        found = binaries()
        if found is None:
            why = "PostgreSQL's server binaries are not installed (apt-get install postgresql)"
            if os.environ.get("CI"):
                pytest.fail(f"{why}: .ci/run installs them, CI must not skip these tests")
            pytest.skip(why)
        self.bin = found
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="specroute-pg-"))
        self._process: subprocess.Popen[bytes] | None = None
        self._as: dict[str, Any] = {}
        if os.geteuid() == 0:
            self._as = {"user": "postgres", "group": "postgres", "extra_groups": []}
            shutil.chown(self.dir, "postgres", "postgres")

    @property
    def log(self) -> str:
        path = self.dir / "server.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def dsn(self, database: str = "postgres", *, port: int | None = None) -> str:
        return f"postgresql://{USER}:{PASSWORD}@127.0.0.1:{port or self.port}/{database}?connect_timeout=5"

    def __enter__(self) -> PostgresServer:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        password_file = self.dir / "password"
        password_file.write_text(PASSWORD + "\n")
        if self._as:
            shutil.chown(password_file, "postgres", "postgres")
        data = self.dir / "data"
        subprocess.run(
            [str(self.bin / "initdb"), "-D", str(data), "-U", USER, "--pwfile", str(password_file),
             "--auth", "scram-sha-256", "-E", "UTF8", "--no-sync"],
            check=True, capture_output=True, env=self._env(), **self._as,
        )  # fmt: skip
        with (self.dir / "server.log").open("wb") as log:
            self._process = subprocess.Popen(
                [str(self.bin / "postgres"), "-D", str(data), "-p", str(self.port), "-k", str(self.dir),
                 "-c", "listen_addresses=127.0.0.1", "-c", "max_connections=100"],
                stdout=log, stderr=subprocess.STDOUT, env=self._env(), **self._as,
            )  # fmt: skip
        deadline = time.monotonic() + 60
        while True:
            assert self._process.poll() is None, f"PostgreSQL did not start:\n{self.log}"
            try:
                psycopg.connect(self.dsn(), connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                assert time.monotonic() < deadline, f"PostgreSQL not ready within 60 s:\n{self.log}"
                time.sleep(0.1)

    def _env(self) -> dict[str, str]:
        return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "HOME": str(self.dir)}

    def database(self, name: str) -> str:
        """A new, empty database; its DSN."""
        with psycopg.connect(self.dsn(), autocommit=True) as db:
            db.execute(f'CREATE DATABASE "{name}"')
        return self.dsn(name)

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGINT)  # fast shutdown: clients are disconnected
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()
