"""Real servers on loopback ports for the tests: uvicorn in a thread, on a port the OS picks."""

from __future__ import annotations

import threading
import time
from types import TracebackType
from typing import Any

import uvicorn

from router.listener import uvicorn_config


class ServerThread:
    def __init__(self, app: Any, *, fast: bool = False) -> None:
        # `fast`: `app` is a router (router.app.create_app), served from its settings exactly as
        # `specroute serve` serves it (uvloop, its connection limits); fakes use uvicorn's defaults.
        self.app = app
        if fast:
            config = uvicorn_config(app, app.state.router.settings, host="127.0.0.1", port=0, log_level="warning")
        else:
            config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def port(self) -> int:
        port: int = self.server.servers[0].sockets[0].getsockname()[1]
        return port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.01)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)
