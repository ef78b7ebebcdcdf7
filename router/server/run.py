"""Running one router process under uvicorn (`specroute serve` with one worker, and each worker)."""

from __future__ import annotations

import signal
from collections.abc import Callable

from router import logs
from router.config import Settings


def run_router(
    settings: Settings,
    *,
    load: Callable[[], Settings] | None = None,
    host: str | None,
    port: int | None,
    log_level: str,
    log_format: logs.LogFormat | None = None,
) -> None:
    from router.app import create_app
    from router.server.listener import uvicorn_config
    from router.server.server import RouterServer

    logs.configure(log_level, log_format or settings.log.format)
    config = uvicorn_config(create_app(settings, load=load), settings, host=host, port=port, log_level=log_level)
    # Once uvicorn has shut down on SIGINT or SIGTERM it raises the signal again, for the handler
    # there before it started; with this one, a router that stopped as asked exits with status 0.
    for stop in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop, lambda number, frame: None)
    RouterServer(config).run()
