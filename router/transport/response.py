"""`EngineResponse`: one engine response as its connection's `Receiver` hears it, read by the
request path (router.transport.base.Response).

Body pieces are kept as llhttp handed them over, decoded from any content coding; past
`_BUFFERED` bytes not yet taken, the connection stops reading until they are. A compressed body
is inflated `_BUFFERED` bytes at a time, one a turn of the event loop, while the reader keeps up:
what a thousandfold expansion (a gzip bomb) would make waits compressed, the connection with it.
Once the response has ended the connection is no longer this response's: nothing here touches
it again.
"""

from __future__ import annotations

import asyncio
import zlib
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence

from router.transport.base import RemoteProtocolError, TooLarge
from router.transport.connection import EngineConnection

_BUFFERED = 256 * 1024
_DECODERS: dict[bytes, Callable[[], zlib._Decompress]] = {
    b"gzip": lambda: zlib.decompressobj(16 + zlib.MAX_WBITS),
    b"x-gzip": lambda: zlib.decompressobj(16 + zlib.MAX_WBITS),
    b"deflate": lambda: zlib.decompressobj(),
}


class EngineResponse:
    def __init__(self, connection: EngineConnection, closed: Callable[[EngineResponse], None]) -> None:
        self._connection: EngineConnection | None = connection
        self._closed = closed
        self.status = 0
        self.headers: Sequence[tuple[bytes, bytes]] = []
        self._started = asyncio.get_running_loop().create_future()
        self._pieces: deque[bytes] = deque()
        self._size = 0  # bytes in `_pieces`
        self._waiter: asyncio.Future[None] | None = None
        self._done = False
        self._error: Exception | None = None  # a TransportError, or what a sink raised
        self._sink: Callable[[bytes], None] | None = None  # while `stream_to` runs
        self._read: Callable[[], None] | None = None  # told after each read, while `stream_to` runs
        self._decoder: zlib._Decompress | None = None
        self._compressed = b""  # received, not yet inflated
        self._full = False  # the last piece inflated filled `_BUFFERED`: zlib may hold more of it
        self._ending = False  # the body has ended, but not yet all that was compressed in it
        self._paused = False  # by the reader (`pause_reading`)
        self._inflating = False  # the next piece's inflating is due at the loop's next turn
        self._aclosed = False

    async def started(self) -> None:
        """Returns once the head has arrived; raises the exchange's failure before it."""
        await self._started

    # -- as the connection's receiver ------------------------------------------------------------

    def head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.status, self.headers = status, headers
        coding = (self.header(b"content-encoding") or b"identity").strip().lower()
        if coding != b"identity":
            decoder = _DECODERS.get(coding)
            if decoder is None:
                self._drop_connection()
                self.failed(RemoteProtocolError(f"a content coding the router does not read: {coding[:32]!r}"))
                return
            self._decoder = decoder()
        self._started.set_result(None)

    def piece(self, data: bytes) -> None:
        if self._decoder is None:
            self._deliver(data)
        else:  # more may come in the read that paused the connection
            self._compressed = self._compressed + data if self._compressed else data
            self._inflate()

    def _deliver(self, data: bytes) -> None:
        if self._sink is not None:
            try:
                self._sink(data)
            except Exception as exc:  # the sink's to report (an event over its limit): the stream ends
                self._drop_connection()
                self.failed(exc)
            return
        self._pieces.append(data)
        self._size += len(data)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        if self._size > _BUFFERED and self._connection is not None:
            self._connection.pause()

    def _inflate(self) -> None:
        """One piece of what is compressed (`_BUFFERED` bytes of output) if the reader keeps up,
        a sink's written out at once; the next at the event loop's next turn, once what this one
        set off (the writes, the client's flow control) has run. The connection waits meanwhile."""
        assert self._decoder is not None
        if self._to_inflate() and self._keeping_up():
            try:
                data = self._decoder.decompress(self._compressed, _BUFFERED)
            except zlib.error as exc:
                self._drop_connection()
                self.failed(RemoteProtocolError(f"the engine's compressed body is corrupt: {exc}"))
                return
            self._compressed = self._decoder.unconsumed_tail
            self._full = len(data) == _BUFFERED
            if data:
                self._deliver(data)
                if self._read is not None and not self._done:
                    self._read()  # a sink's piece goes out now: the client's flow control hears of it
        if self._to_inflate():
            if self._connection is not None:
                self._connection.pause()
            if self._keeping_up() and not self._inflating:
                self._inflating = True
                asyncio.get_running_loop().call_soon(self._inflate_next)
        elif self._ending:
            self._end()
        elif self._keeping_up() and self._connection is not None:
            self._connection.resume()

    def _inflate_next(self) -> None:
        self._inflating = False
        self._more()

    def _to_inflate(self) -> bool:
        """Compressed bytes wait, or output of those inflated last (the rest of a back-reference
        the output's limit cut, with every input byte read)."""
        return bool(self._compressed) or self._full

    def _keeping_up(self) -> bool:
        return not self._done and not self._paused and self._size < _BUFFERED

    def _more(self) -> None:
        """The reader took what it had, or wants more (outside the connection's reads)."""
        if self._decoder is not None:
            self._inflate()
        elif self._connection is not None and not self._paused:
            self._connection.resume()

    def read_done(self) -> None:
        if self._read is not None and not self._done:  # the body's end is the caller's to pass on
            self._read()

    def end(self) -> None:
        self._connection = None
        if self._decoder is not None and self._to_inflate():  # the rest, as the reader takes it
            self._ending = True
            return
        self._end()

    def _end(self) -> None:
        self._ending = False
        if self._decoder is not None and (tail := self._decoder.flush()):
            self._deliver(tail)
        if not self._done:
            self._done = True
            self._wake()

    def failed(self, exc: Exception) -> None:
        self._connection = None
        if self._done:
            return
        self._done = True
        self._error = exc
        if not self._started.done():
            self._started.set_exception(exc)
            self._started.exception()  # retrieved: one never awaited is not an error to log
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _drop_connection(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()

    # -- as the request path's Response ------------------------------------------------------------

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    async def iter_raw(self) -> AsyncIterator[bytes]:
        pieces = self._pieces
        while True:
            if pieces:
                # What has arrived since the last look, whole: one piece as it came in the common case.
                data = pieces.popleft() if len(pieces) == 1 else b"".join(pieces)
                pieces.clear()
                self._size = 0
                self._more()
                yield data
            elif self._done:
                if self._error is not None:
                    raise self._error
                return
            else:
                self._waiter = asyncio.get_running_loop().create_future()
                await self._waiter
                self._waiter = None

    async def stream_to(self, sink: Callable[[bytes], None], read: Callable[[], None] | None = None) -> None:
        """Each body piece to `sink` as it arrives, called in the connection's callbacks; returns
        at the body's end, raises its failure (or what `sink` raised). `read()` after the pieces
        already here and after each read but the body's last (router.transport.base.Response)."""
        if self._pieces:
            data = b"".join(self._pieces)
            self._pieces.clear()
            self._size = 0
            sink(data)
        if not self._done:
            if read is not None:
                read()
            self._sink, self._read = sink, read
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                self._more()
                await self._waiter
            finally:
                self._sink = self._read = self._waiter = None
        if self._error is not None:
            raise self._error

    def pause_reading(self) -> None:
        self._paused = True
        if self._connection is not None:
            self._connection.pause()

    def resume_reading(self) -> None:
        self._paused = False
        self._more()

    async def read(self, *, limit: int) -> bytes:
        declared = self.header(b"content-length")
        if declared is not None and self._decoder is None and declared.isdigit() and int(declared) > limit:
            raise TooLarge(f"the response body ({int(declared)} bytes) is over the {limit} byte limit")
        chunks, size = [], 0
        async for chunk in self.iter_raw():
            size += len(chunk)
            if size > limit:
                raise TooLarge(f"the response body is over the {limit} byte limit")
            chunks.append(chunk)
        return b"".join(chunks)

    async def aclose(self) -> None:
        """Not read to its end: the connection is closed (it cannot carry another request)."""
        self._drop_connection()
        self._done = True
        if not self._aclosed:
            self._aclosed = True
            self._closed(self)
