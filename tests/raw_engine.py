"""Hostile engines: raw asyncio servers on loopback that send exactly the bytes a test chooses.

Each runs its own event loop in a thread (the router under test runs in another), reads every
request itself, answers the router's probes (`/health`, `/metrics`, `/v1/models`) plainly, and
hands each POST to the test's `answer`, which writes whatever it likes and says whether the
connection stays open.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType


@dataclass(frozen=True, slots=True)
class Exchange:
    index: int  # 0 for the first POST this engine received, 1 for the next...
    connection: int  # 1 for the first connection this engine accepted, 2 for the next...
    earlier: int  # requests (probes included) read on the same connection before this one
    method: str
    target: str
    headers: dict[str, str]  # lower-cased names
    body: bytes

    @property
    def request_id(self) -> str:
        return self.headers.get("x-request-id", "")


# Writes the answer; returns whether to keep reading requests on this connection.
Answer = Callable[[Exchange, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool]]


def completion(exchange: Exchange) -> bytes:
    """A chat completion whose text is the request's id: who got whose answer is plain to see."""
    return json.dumps(
        {
            "id": "cmpl-" + exchange.request_id,
            "object": "chat.completion",
            "created": 0,
            "model": "test-model",
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": exchange.request_id}, "finish_reason": "stop"}
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
    ).encode()


def response(status: int = 200, body: bytes = b"", *, headers: bytes = b"", version: bytes = b"HTTP/1.1") -> bytes:
    length = b"content-length: %d\r\n" % len(body)
    return b"%s %d X\r\n%scontent-type: application/json\r\n%s\r\n%s" % (version, status, length, headers, body)


async def answer_normally(exchange: Exchange, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    writer.write(response(body=completion(exchange)))
    return True


class RawEngine:
    def __init__(
        self, answer: Answer = answer_normally, *, tls: ssl.SSLContext | None = None, keep_alive: bool = True
    ) -> None:
        self.answer = answer
        self.tls = tls  # serve https with this context
        self.keep_alive = keep_alive  # False: the probes' connections are closed after each answer too
        self.requests: list[Exchange] = []  # every POST read, in order
        self.heads: list[bytes] = []  # the head of every request read (probes too), byte for byte
        self.connections = 0  # accepted
        self.closed: set[int] = set()  # the numbers of the connections closed since
        self.written = 0  # bytes an answer counted as sent (for the bounded-buffer tests)
        self.probe_answers: dict[int, bytes] = {}  # per connection, the last answer to a GET on it
        self._idle: set[asyncio.StreamWriter] = set()  # connections waiting for their next request
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    def __enter__(self) -> RawEngine:
        self._thread.start()
        start = asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.tls)
        self._server = asyncio.run_coroutine_threadsafe(start, self._loop).result(10)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        async def stop() -> None:
            assert self._server is not None
            self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def close_idle(self) -> int:
        """Close every connection waiting for a request, as uvicorn does after its keep-alive time
        (a FIN, nothing read); returns how many, once each is closed. It blocks the calling thread,
        so a caller on an event loop keeps that loop from seeing the FINs until it awaits."""

        async def close() -> int:
            idle, self._idle = self._idle, set()
            for writer in idle:
                writer.close()
            await asyncio.gather(*(writer.wait_closed() for writer in idle), return_exceptions=True)
            return len(idle)

        return asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)

    def wait_for(self, condition: Callable[[], bool], timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        earlier = 0
        try:
            while True:
                self._idle.add(writer)
                exchange = await self._read(reader, number, earlier)
                self._idle.discard(writer)
                if exchange is None:
                    break
                earlier += 1
                if exchange.method == "GET":
                    body = b'{"object": "list", "data": []}' if exchange.target == "/v1/models" else b""
                    # The request's id echoed, as vLLM does with --enable-request-id-headers.
                    echo = b"x-request-id: %s\r\n" % exchange.request_id.encode() if exchange.request_id else b""
                    answer = response(body=body, headers=echo + (b"" if self.keep_alive else b"connection: close\r\n"))
                    self.probe_answers[number] = answer
                    writer.write(answer)
                    await writer.drain()
                    if not self.keep_alive:
                        break
                    continue
                self.requests.append(exchange)
                keep = await self.answer(exchange, reader, writer)
                await writer.drain()
                if not keep:
                    break
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ssl.SSLError):
            pass  # the router closed the connection: what several tests expect
        finally:
            self._idle.discard(writer)
            self.closed.add(number)
            writer.close()

    async def _read(self, reader: asyncio.StreamReader, connection: int, earlier: int) -> Exchange | None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return None
        self.heads.append(head)
        line, *fields = head.decode("latin-1").split("\r\n")
        method, target, _ = line.split(" ", 2)
        headers = {}
        for field in fields:
            if ":" in field:
                name, value = field.split(":", 1)
                headers[name.strip().lower()] = value.strip()
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        return Exchange(len(self.requests), connection, earlier, method, target, headers, body)
