"""A minimal HTTP/1.1 server for an ASGI app that can misbehave on the wire, as a broken engine
(or something between the router and it) might: interim 1xx answers before the real one, and a
second copy of an answer, sent unasked on the idle keep-alive connection after it.

Just enough HTTP for what the router sends an engine: requests with a Content-Length body,
keep-alive, answers with a Content-Length or chunked. uvicorn cannot be made to misbehave, so the
soak's chaos engine (scripts/soak.py engine --wire) and the tests of this module use this one.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

INTERIM = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </hint.css>; rel=preload\r\n\r\n"


@dataclass(frozen=True)
class WireChaos:
    interim: float = 0.0  # share of answers preceded by `100 Continue` and `103 Early Hints`
    late: float = 0.0  # share of answers sent a second time once the connection has idled...
    late_after: float = 0.05  # ...this many seconds
    seed: int | None = None


class WireServer:
    def __init__(self, app: Any, chaos: WireChaos) -> None:
        self.app = app
        self.chaos = chaos
        self.counts = {"interim": 0, "late": 0}
        self._rng = random.Random(chaos.seed)

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> asyncio.Server:
        return await asyncio.start_server(self._connection, host, port)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        late: bytes | None = None  # the last answer, if it is to be sent again
        try:
            while True:
                try:
                    if late is None:
                        head = await reader.readuntil(b"\r\n\r\n")
                    else:
                        # A cancelled readuntil leaves what it had in the buffer: nothing is lost.
                        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.chaos.late_after)
                except TimeoutError:
                    assert late is not None
                    writer.write(late)
                    self.counts["late"] += 1
                    late = None
                    continue
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                    return
                request_line, *lines = head.decode("latin-1").split("\r\n")[:-2]
                method, target, _ = request_line.split(" ", 2)
                headers = [
                    (n.strip().lower().encode(), v.strip().encode()) for n, v in (h.split(":", 1) for h in lines)
                ]
                length = int(dict(headers).get(b"content-length", b"0"))
                body = await reader.readexactly(length)
                answer = await self._answer(method, target, headers, body, reader, writer)
                if dict(headers).get(b"connection", b"").lower() == b"close" or writer.is_closing():
                    return
                late = answer if self._rng.random() < self.chaos.late else None
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()

    async def _answer(
        self,
        method: str,
        target: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> bytes:
        """Run the app for one request, write its answer; return the answer's bytes."""
        path, _, query = target.partition("?")
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": query.encode(),
            "root_path": "",
            "headers": headers,
            "client": writer.get_extra_info("peername"),
            "server": writer.get_extra_info("sockname"),
        }
        sent = bytearray()
        pending: list[bytes] = [INTERIM] if self._rng.random() < self.chaos.interim else []
        self.counts["interim"] += bool(pending)
        chunked = False
        body_sent = False

        def gone() -> bool:
            return reader.at_eof() or reader.exception() is not None or writer.is_closing()

        async def receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            # The stream's protocol reads in the background and marks EOF: no event to wait on.
            while not gone():  # noqa: ASYNC110
                await asyncio.sleep(0.01)
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            nonlocal chunked
            if gone():
                raise OSError("the client went away")
            if message["type"] == "http.response.start":
                names = {name.lower() for name, _ in message.get("headers", [])}
                chunked = b"content-length" not in names
                lines = [f"HTTP/1.1 {message['status']} {HTTPStatus(message['status']).phrase}".encode()]
                lines += [name + b": " + value for name, value in message.get("headers", [])]
                lines += [b"transfer-encoding: chunked"] if chunked else []
                pending.append(b"\r\n".join(lines) + b"\r\n\r\n")
                return
            data = message.get("body", b"")
            more = message.get("more_body", False)
            if chunked:
                pending.append((b"%x\r\n%s\r\n" % (len(data), data) if data else b"") + (b"" if more else b"0\r\n\r\n"))
            else:
                pending.append(data)
            piece = b"".join(pending)
            pending.clear()
            sent.extend(piece)
            writer.write(piece)
            await writer.drain()

        await self.app(scope, receive, send)
        return bytes(sent).removeprefix(INTERIM)
