"""The supervisor of `specroute serve --workers N`: it holds the port, keeps the figures the
workers share (router.workers.figures) on a Unix socket, and runs the workers.

- the port is bound here first (`SO_REUSEPORT`, not listening), so that port 0 becomes one port
  for all, a restarted worker binds the same one, and nothing else of another user can take it;
- a worker that dies is restarted at once; one that dies `_RESTARTS` times within `_WINDOW`
  seconds is a crash loop: every worker is stopped and `serve` exits 1, loudly;
- SIGTERM or SIGINT: every worker drains as a single router does, and the supervisor exits once
  all have; SIGHUP: every worker reloads the configuration file.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from router.workers.figures import Figures
from router.workers.store import serve_figures
from router.workers.worker import listening_socket

logger = logging.getLogger("specroute.workers")

_RESTARTS = 5
_WINDOW = 60.0


class Supervisor:
    def __init__(
        self,
        figures: Figures,
        *,
        config: str,
        workers: int,
        host: str,
        port: int,
        log_level: str,
        log_format: str | None,
    ) -> None:
        self._figures = figures
        self._config = config
        self._count = workers
        self._host = host
        self._port = port
        self._log = ["--log-level", log_level, *(["--log-format", log_format] if log_format else [])]
        self._rundir = Path(tempfile.mkdtemp(prefix="specroute-workers-"))  # mode 0700
        self._processes: dict[int, asyncio.subprocess.Process] = {}
        self._deaths: list[float] = []
        self._stopping = asyncio.Event()
        self._failed = False

    async def run(self) -> int:
        reserved = listening_socket(self._host, self._port, listen=False)
        self._port = reserved.getsockname()[1]
        server = await serve_figures(str(self._rundir / "figures.sock"), self._figures)
        loop = asyncio.get_running_loop()
        for stop in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(stop, self._stopping.set)
        loop.add_signal_handler(signal.SIGHUP, self._signal_all, signal.SIGHUP)
        logger.info("specroute: %d workers on %s port %d", self._count, self._host, self._port)
        try:
            watches = [asyncio.create_task(self._keep(index)) for index in range(self._count)]
            await self._stopping.wait()
            self._signal_all(signal.SIGTERM)
            await asyncio.gather(*watches)
        finally:
            server.close()
            reserved.close()
            shutil.rmtree(self._rundir, ignore_errors=True)
        return 1 if self._failed else 0

    async def _keep(self, index: int) -> None:
        """Run worker `index`, and again each time it dies, until the supervisor stops."""
        while not self._stopping.is_set():
            process = self._processes[index] = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "router.workers.worker",
                *("--index", str(index), "--supervisor", str(os.getpid()), "--workers", str(self._count)),
                *("--rundir", str(self._rundir)),
                *("--config", self._config, "--host", self._host, "--port", str(self._port), *self._log),
            )
            if self._stopping.is_set():
                process.send_signal(signal.SIGTERM)  # started as the others were told to stop
            code = await process.wait()
            if self._stopping.is_set():
                return
            self._died(index, process.pid, code)

    def _died(self, index: int, pid: int, code: int) -> None:
        now = time.monotonic()
        self._deaths = [when for when in self._deaths if now - when < _WINDOW] + [now]
        how = f"signal {-code}" if code < 0 else f"status {code}"
        if len(self._deaths) >= _RESTARTS:
            logger.critical(
                "worker %d (pid %d) ended with %s: %d worker deaths within %g s, stopping every worker",
                *(index, pid, how, len(self._deaths), _WINDOW),
            )
            self._failed = True
            self._stopping.set()
            return
        logger.error("worker %d (pid %d) ended with %s: restarting it", index, pid, how)

    def _signal_all(self, number: int) -> None:
        for process in self._processes.values():
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(number)


def serve_workers(
    *,
    config: str,
    workers: int,
    host: str,
    port: int,
    memory: float,
    max_clients: int,
    log_level: str,
    log_format: str | None,
) -> int:
    """Run `workers` workers of the router configured in the file `config` until told to stop;
    `memory` and `max_clients`: the shared client peaks' half-life and cap (read at start)."""
    import uvloop

    figures = Figures(memory=memory, max_clients=max_clients, clock=time.monotonic)
    supervisor = Supervisor(
        figures, config=config, workers=workers, host=host, port=port, log_level=log_level, log_format=log_format
    )
    return uvloop.run(supervisor.run())
