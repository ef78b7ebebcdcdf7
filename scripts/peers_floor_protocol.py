"""The floor at the protocol level: a relay on asyncio protocol callbacks under uvloop.

Both sides are parsed by httptools (llhttp), as uvicorn's server is; each request goes to the
next engine in turn on a kept-alive connection; each body piece the engine's parser hands over
is written straight to the client's transport as one chunk of a chunked response. Flow control
pauses reading on the other side. No task, stream reader, future or ASGI message per chunk: one
task per new engine connection (asyncio's connect is a coroutine), nothing per request on a
pooled one. No routing, no metrics, no log, no limits: what a relay at this level cannot go
under, beside the router in the peers benchmark (scripts/bench_peers.py, target floor-protocol).

    python scripts/peers_floor_protocol.py --port 8000 --engine http://127.0.0.1:9001 --engine ...
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
from http import HTTPStatus
from typing import cast
from urllib.parse import urlsplit

import httptools
import uvloop

_HEALTH = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"
_END = b"0\r\n\r\n"


class Engines:
    """The engines' addresses in turn, and each one's idle kept-alive connections."""

    def __init__(self, urls: list[str]) -> None:
        self._turn = itertools.cycle([(u.hostname or "127.0.0.1", u.port or 80) for u in map(urlsplit, urls)])
        self._idle: dict[tuple[str, int], list[EngineSide]] = {}

    def send(self, client: ClientSide, request: bytes) -> None:
        address = next(self._turn)
        idle = self._idle.setdefault(address, [])
        while idle:
            engine = idle.pop()
            if not engine.transport.is_closing():
                engine.start(client, request)
                return
        asyncio.get_running_loop().create_task(self._connect(address, client, request))

    async def _connect(self, address: tuple[str, int], client: ClientSide, request: bytes) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, engine = await loop.create_connection(lambda: EngineSide(self, address), *address)
        except OSError:
            client.failed()
            return
        engine.start(client, request)

    def give_back(self, engine: EngineSide) -> None:
        self._idle.setdefault(engine.address, []).append(engine)


class ClientSide(asyncio.Protocol):
    def __init__(self, engines: Engines) -> None:
        self.engines = engines
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport
        self.engine: EngineSide | None = None
        self._url = b""
        self._body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is one, though not by class

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        url, body = self._url, b"".join(self._body)
        self._url, self._body = b"", []
        if url == b"/health":
            self.transport.write(_HEALTH)
            return
        head = b"POST %s HTTP/1.1\r\nhost: engine\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
        self.engines.send(self, head % (url, len(body)) + body)

    def failed(self) -> None:
        self.transport.write(b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        self.transport.close()

    def pause_writing(self) -> None:
        if self.engine is not None:
            self.engine.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.engine is not None:
            self.engine.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.engine is not None:  # gone under way: the engine's request ends with it
            self.engine.transport.close()


class EngineSide(asyncio.Protocol):
    def __init__(self, engines: Engines, address: tuple[str, int]) -> None:
        self.engines, self.address = engines, address
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport
        self.client: ClientSide | None = None
        self._content_type = b"application/json"
        self._out: list[bytes] = []  # what one read brought, framed: written once after it

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is one, though not by class

    def start(self, client: ClientSide, request: bytes) -> None:
        self.client, client.engine = client, self
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()
        self._flush()

    def _flush(self) -> None:
        # llhttp calls on_body once per chunk of a chunked body: one write per read, not per event.
        if self._out and self.client is not None:
            self.client.transport.writelines(self._out)
        self._out.clear()

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self._content_type = value

    def on_headers_complete(self) -> None:
        assert self.client is not None
        status = self.parser.get_status_code()
        head = b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ntransfer-encoding: chunked\r\n\r\n"
        self.client.transport.write(head % (status, HTTPStatus(status).phrase.encode(), self._content_type))

    def on_body(self, body: bytes) -> None:
        self._out += (b"%x\r\n" % len(body), body, b"\r\n")

    def on_message_complete(self) -> None:
        self._out.append(_END)
        self._flush()
        client, self.client = self.client, None
        assert client is not None
        client.engine = None
        if self.parser.should_keep_alive():
            self.engines.give_back(self)
        else:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.client is not None:  # broken under way: so is the client's answer
            self.client.engine = None
            self.client.transport.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--engine", action="append", required=True)
    args = parser.parse_args()

    async def serve() -> None:
        engines = Engines(args.engine)
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: ClientSide(engines), "127.0.0.1", args.port, backlog=4096)
        await server.serve_forever()

    uvloop.run(serve())


if __name__ == "__main__":
    main()
