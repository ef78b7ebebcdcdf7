"""The floor of the router's stack: a relay with nothing in it but uvicorn and aiohttp.

A raw ASGI app under uvicorn (uvloop, httptools), the router's server, that sends every request
to the next of the engines in turn with one aiohttp session, the router's client, and relays
the answer as it arrives: no parsing, no routing, no metrics, no log. What it costs per chunk
is what the router cannot go under without another server or client (docs/benchmarks.md §6).

`--server` measures the same relay on another server, to see whether one would lower the floor:
`granian` (the same ASGI app under Granian, a Rust HTTP server, one worker, uvloop) or `aiohttp`
(aiohttp's own web server, uvloop, with a handler doing the same).

    python scripts/peers_floor.py --port 8000 --engine http://127.0.0.1:9001 --engine http://127.0.0.1:9002
"""

from __future__ import annotations

import argparse
import itertools
import os
from pathlib import Path
from typing import Any

import aiohttp
import uvicorn


def create_app(engines: list[str]) -> Any:
    turn = itertools.cycle(engines)
    session: aiohttp.ClientSession | None = None

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        nonlocal session
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            if session is not None:
                await session.close()
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        if session is None:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4)
            session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))
        headers = {"content-type": "application/json"}
        async with session.post(next(turn) + scope["path"], data=body, headers=headers) as response:
            await send({"type": "http.response.start", "status": response.status,
                        "headers": [(b"content-type", response.headers["content-type"].encode())]})  # fmt: skip
            while chunk := await response.content.readany():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    return app


def aiohttp_app(engines: list[str]) -> Any:
    from aiohttp import web

    turn = itertools.cycle(engines)

    async def start(app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4)
        app["session"] = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))

    async def stop(app: web.Application) -> None:
        await app["session"].close()

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {"content-type": "application/json"}
        async with request.app["session"].post(next(turn) + request.path, data=body, headers=headers) as upstream:
            response = web.StreamResponse(
                status=upstream.status, headers={"content-type": upstream.headers["content-type"]}
            )
            await response.prepare(request)
            while chunk := await upstream.content.readany():
                await response.write(chunk)
        await response.write_eof()
        return response

    app = web.Application()
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_get("/health", health)
    app.router.add_post("/{tail:.*}", relay)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--engine", action="append", required=True)
    parser.add_argument("--server", choices=["uvicorn", "granian", "aiohttp"], default="uvicorn")
    args = parser.parse_args()
    if args.server == "granian":
        from granian.constants import Interfaces, Loops
        from granian.server import Server

        # Granian imports the app by name in its worker process: the engines go there by the environment.
        os.environ["PEERS_FLOOR_ENGINES"] = ",".join(args.engine)
        Server("peers_floor:granian_app", address="127.0.0.1", port=args.port, interface=Interfaces.ASGI,
               workers=1, loop=Loops.uvloop, log_enabled=False, backlog=4096, factory=True,
               working_dir=Path(__file__).parent, websockets=False).serve()  # fmt: skip
    elif args.server == "aiohttp":
        import uvloop
        from aiohttp import web

        uvloop.install()
        web.run_app(aiohttp_app(args.engine), host="127.0.0.1", port=args.port, access_log=None, print=None,
                    backlog=4096)  # fmt: skip
    else:
        uvicorn.run(create_app(args.engine), host="127.0.0.1", port=args.port, loop="uvloop", http="httptools",
                    log_level="warning", access_log=False, backlog=4096)  # fmt: skip


def granian_app() -> Any:
    return create_app(os.environ["PEERS_FLOOR_ENGINES"].split(","))


if __name__ == "__main__":
    main()
