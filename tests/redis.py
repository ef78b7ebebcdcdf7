"""A real Redis server for the tests: Debian's `redis-server`, on a free loopback port, with no
persistence, started, killed and started again on the same port by the test."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import pytest

from tests.servers import free_port


def _binary() -> str:
    found = shutil.which("redis-server")
    if found is None:
        why = "redis-server is not installed (apt-get install redis-server)"
        if os.environ.get("CI"):
            pytest.fail(f"{why}: .ci/run installs it, CI must not skip these tests")
        pytest.skip(why)
    return found


class RedisServer:
    """`with RedisServer() as server:` a running server at `server.url`; `kill()` and `start()`
    take it away and bring it back (empty) on the same port."""

    def __init__(self) -> None:
        self.binary = _binary()
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="specroute-redis-"))
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log(self) -> str:
        path = self.dir / "redis.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def start(self) -> None:
        self._process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.dir), "--logfile", str(self.dir / "redis.log"), "--daemonize", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while not self._answers():
            assert self._process.poll() is None, f"redis-server did not start:\n{self.log}"
            assert time.monotonic() < deadline, f"redis-server not ready within 30 s:\n{self.log}"
            time.sleep(0.02)

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as connection:
                connection.sendall(b"PING\r\n")
                return connection.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """As a crash: SIGKILL, nothing saved."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGKILL)
            self._process.wait()

    def __enter__(self) -> RedisServer:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()
