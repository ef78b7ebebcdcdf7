"""Real servers on loopback ports for the tests: uvicorn in a thread, on a port the OS picks, or
`specroute serve` in a process of its own (`serve`)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import uvicorn

from router.server.listener import uvicorn_config
from tests.wait import wait_until

# The test running now if it is in the fast unit set (marked neither `e2e` nor `real`): set by
# tests/conftest.py, so that such a test cannot start a server and slow the set down unseen.
unmarked_test: str | None = None


def _may_serve() -> None:
    assert unmarked_test is None, f"{unmarked_test} serves on loopback: mark it e2e (pyproject.toml, markers)"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@contextmanager
def serve(
    config: Path,
    *,
    env: Mapping[str, str] | None = None,
    own_session: bool = False,
    args: Sequence[str] = (),
    port: int | None = None,
) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`specroute serve --config FILE` in its own process, its log beside the file; yields it and
    its URL once it answers. It gets this process's environment but for `SPECROUTE_*`, plus `env`.
    `own_session`: in a session of its own, which Linux gives a fair share of the CPU of its own
    (an autogroup) beside this process and any other session's busy processes. `port`: the one to
    listen on (else a free one)."""
    _may_serve()
    port = port if port is not None else free_port()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SPECROUTE_")} | dict(env or {})
    log = (config.parent / "router.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "router.cli", "serve", "--config", str(config), "--port", str(port), *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        env=environ,
        start_new_session=own_session,
    )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert process.poll() is None, (config.parent / "router.log").read_text()
        try:
            return httpx.get(url + "/healthz", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(up, timeout=60, interval=0.05, message="the router answers /healthz")
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        if own_session:
            _end_session(process.pid)
        log.close()


def _end_session(leader: int) -> None:
    """Whatever the router left in its session once it is gone (its worker processes stop on their
    own when their supervisor dies: tests/workers holds that), killed if still there after 30 s."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(leader, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(leader, signal.SIGKILL)


class ServerThread:
    def __init__(self, app: Any, *, fast: bool = False, host: str = "127.0.0.1", port: int = 0) -> None:
        # `fast`: `app` is a router (router.app.create_app), served from its settings exactly as
        # `specroute serve` serves it (uvloop, its connection limits); fakes use uvicorn's defaults.
        # `host`: another loopback address (127.0.0.2, ...), for engines that share a port.
        self.app = app
        self.host = host
        if fast:
            config = uvicorn_config(app, app.state.router.settings, host=host, port=port, log_level="warning")
        else:
            config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def port(self) -> int:
        port: int = self.server.servers[0].sockets[0].getsockname()[1]
        return port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> ServerThread:
        _may_serve()
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Ask the server to stop, without waiting for it (its exit waits)."""
        self.server.should_exit = True

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
        self._thread.join(timeout=10)


def stop_together(servers: Iterable[ServerThread]) -> None:
    """Ask every server to stop at once; each one's exit then only waits for its own thread. One
    after another, each takes 0.15-0.2 s to stop (uvicorn looks every 0.1 s whether to stop, then
    gives its connections 0.1 s): a cluster's router and then its two engines took 0.5 s, the
    router and then both engines together 0.33 s."""
    for server in servers:
        server.stop()
