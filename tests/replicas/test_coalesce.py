"""`Coalesced`: a lone call goes at once; calls that arrive while a round is under way go
together in the next; a failing round fails its callers only; a caller that stops waiting
leaves its round to the others."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from router.replicas.coalesce import Coalesced

pytestmark = pytest.mark.anyio


class Rounds:
    """A `send` that answers each item doubled, once `release` is set, and keeps its rounds."""

    def __init__(self) -> None:
        self.rounds: list[list[int]] = []
        self.release = asyncio.Event()
        self.fail_with: Exception | None = None

    async def __call__(self, items: Sequence[int]) -> list[int]:
        self.rounds.append(list(items))
        await self.release.wait()
        if self.fail_with is not None:
            raise self.fail_with
        return [item * 2 for item in items]


async def test_calls_during_a_round_go_together_in_the_next() -> None:
    send = Rounds()
    coalesced = Coalesced(send)
    first = asyncio.create_task(coalesced(1))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert send.rounds == [[1]]  # a lone call went at once
    rest = [asyncio.create_task(coalesced(n)) for n in (2, 3, 4)]
    await asyncio.sleep(0)
    assert send.rounds == [[1]]  # waiting for the round under way
    send.release.set()
    assert await asyncio.gather(first, *rest) == [2, 4, 6, 8]
    assert send.rounds == [[1], [2, 3, 4]]


async def test_a_failed_round_fails_its_callers_and_the_next_goes_on() -> None:
    send = Rounds()
    coalesced = Coalesced(send)
    send.fail_with = ConnectionError("gone")
    failing = asyncio.create_task(coalesced(1))
    await asyncio.sleep(0)
    send.release.set()
    with pytest.raises(ConnectionError):
        await failing
    send.fail_with = None
    assert await coalesced(5) == 10


async def test_a_caller_that_stops_waiting_leaves_the_others_their_answers() -> None:
    send = Rounds()
    coalesced = Coalesced(send)
    gone = asyncio.create_task(coalesced(1))
    stays = asyncio.create_task(coalesced(2))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    gone.cancel()
    send.release.set()
    assert await stays == 4
    assert gone.cancelled()


async def test_closing_cancels_the_callers_of_a_round_under_way() -> None:
    send = Rounds()
    coalesced = Coalesced(send)
    waiting = asyncio.create_task(coalesced(1))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    await coalesced.aclose()
    with pytest.raises(asyncio.CancelledError):
        await waiting
