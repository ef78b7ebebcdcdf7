"""Running a router under uvicorn, with what its operator expects of a server process:

- SIGTERM (or Ctrl-C): stop accepting connections, let running requests finish for
  `shutdown.grace_seconds`, then end the streams still open with an error event, and exit;
- SIGHUP: reload the configuration file (an invalid one is logged and changes nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import socket

import uvicorn
from starlette.applications import Starlette

from router.runtime import Router

# uvicorn's own limit, after the router has ended its streams: for requests that are not yet
# the router's (a client still sending its body, bounded by timeouts.client_body).
_BACKSTOP_SECONDS = 5.0


class RouterServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        app = config.app
        assert isinstance(app, Starlette), "RouterServer serves the app of router.app.create_app"
        self.router: Router = app.state.router

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        # Only the main thread of a POSIX process gets signals (not a router run in a test thread).
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.router.reload_logged)
        # What was built to serve (modules, settings, the app and its parts) lives as long as the
        # process: out of the collector's reach, its passes scan only what requests leave behind.
        # What of it dies later in a cycle stays: once, whatever the number of reloads, until the
        # server stops (see `shutdown`).
        gc.collect()
        gc.freeze()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.router.begin_shutdown()
        self.config.timeout_graceful_shutdown = round(self.router.grace_seconds + _BACKSTOP_SECONDS)
        try:
            await super().shutdown(sockets)
        finally:
            # Back in the collector's reach: in a process that goes on (a test run, a router
            # served twice) what it built is collected, and what else was alive at the freeze.
            gc.unfreeze()
