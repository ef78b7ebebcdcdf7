"""`Coalesced`: calls that arrive while one round trip is under way go together in the next.

A burst of requests claiming slots would otherwise each take a connection and a round trip,
and each its share of the event loop's time to send and parse; together they take one, and a
lone call goes out at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

_A = TypeVar("_A")
_R = TypeVar("_R")


class Coalesced(Generic[_A, _R]):
    """`send` takes the items gathered, in order, and answers one result for each."""

    def __init__(self, send: Callable[[Sequence[_A]], Awaitable[Sequence[_R]]]) -> None:
        self._send = send
        self._waiting: list[tuple[_A, asyncio.Future[_R]]] = []
        self._round: asyncio.Task[None] | None = None

    async def __call__(self, item: _A) -> _R:
        future: asyncio.Future[_R] = asyncio.get_running_loop().create_future()
        self._waiting.append((item, future))
        if self._round is None:
            self._round = asyncio.create_task(self._rounds())
        return await future  # a caller that stops waiting leaves its round to the others

    async def _rounds(self) -> None:
        batch: list[tuple[_A, asyncio.Future[_R]]] = []
        try:
            while self._waiting:
                batch, self._waiting = self._waiting, []
                try:
                    results = await self._send([item for item, _ in batch])
                    if len(results) != len(batch):
                        raise RuntimeError(f"{len(results)} results for {len(batch)} calls")
                except Exception as exc:
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                for (_, future), result in zip(batch, results, strict=True):
                    if not future.done():
                        future.set_result(result)
        finally:
            self._round = None
            for _, future in batch + self._waiting:  # cancelled (the router ends): none left waiting
                future.cancel()
            self._waiting = []

    async def aclose(self) -> None:
        if self._round is not None:
            self._round.cancel()
            await asyncio.gather(self._round, return_exceptions=True)
