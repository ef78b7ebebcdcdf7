"""One worker process: a whole router accepting on the shared port (`SO_REUSEPORT`) and on a
private Unix socket the other workers reach it by, sharing its figures through the supervisor.

Run by the supervisor (router.workers.supervisor) as `python -m router.workers.worker ...`.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from router import logs
from router.config import load_settings
from router.workers.peers import Peers
from router.workers.store import SocketStore

if TYPE_CHECKING:
    from router.server.server import RouterServer


def listening_socket(host: str, port: int, *, listen: bool = True) -> socket.socket:
    """A TCP socket on `host`:`port` that other processes of this user may bind as well: the
    kernel spreads new connections over those listening (`SO_REUSEPORT`)."""
    [(family, kind, proto, _, address), *_] = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(address)
    if listen:
        sock.listen(2048)
    return sock


def private_socket(path: Path) -> socket.socket:
    path.unlink(missing_ok=True)  # a dead worker's, before this one took its place
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    os.chmod(path, 0o600)
    sock.listen(64)
    return sock


def _stop_when_asked(server: RouterServer, supervisor: int, asked: threading.Event) -> None:
    """Stop the worker through uvicorn's own SIGTERM once it serves, if a stop signal came while it
    was starting (before uvicorn took the signals over) or its supervisor is gone (killed, perhaps
    before this worker even started: its parent is then no longer `supervisor`)."""
    while not asked.is_set() and os.getppid() == supervisor:
        time.sleep(1)
    while not server.started:
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="specroute worker")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--supervisor", type=int, required=True, help="the supervisor's process id")
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--rundir", required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--log-format", choices=["text", "json"])
    args = parser.parse_args(argv)

    from router.app import create_app
    from router.server.listener import uvicorn_config
    from router.server.server import RouterServer

    settings = load_settings(args.config)
    logs.configure(args.log_level, args.log_format or settings.log.format)
    rundir = Path(args.rundir)
    peers = Peers(index=args.index, count=args.workers, rundir=rundir)
    # With Redis configured, each worker is a replica there; else the supervisor keeps the figures.
    store = SocketStore(str(rundir / "figures.sock")) if settings.state.redis_url is None else None
    app = create_app(settings, load=lambda: load_settings(args.config), workers=peers, store=store)
    config = uvicorn_config(app, settings, host=args.host, port=args.port, log_level=args.log_level)
    sockets = [listening_socket(args.host, args.port), private_socket(peers.path(args.index))]
    server = RouterServer(config)
    asked = threading.Event()
    for stop in (signal.SIGINT, signal.SIGTERM):  # until uvicorn's handlers, and after (router.server.run)
        signal.signal(stop, lambda number, frame: asked.set())
    threading.Thread(target=_stop_when_asked, args=(server, args.supervisor, asked), daemon=True).start()
    server.run(sockets=sockets)


if __name__ == "__main__":
    main()
