"""Waiting for a condition with a deadline: how a test waits for another thread or process.

A fixed sleep is either too short on a busy machine or wasted on an idle one; these return as
soon as the condition holds and fail, saying what was awaited, only once the deadline has passed.
The deadlines are generous on purpose: a healthy run never comes near them.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

T = TypeVar("T")

TIMEOUT = 15.0


def wait_until(
    predicate: Callable[[], T], *, timeout: float = TIMEOUT, interval: float = 0.01, message: str = "condition"
) -> T:
    """Poll `predicate` until it returns something true and return that; AssertionError after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        if value := predicate():
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {message} (last: {value!r})")
        time.sleep(interval)


@overload
async def until(
    predicate: Callable[[], Awaitable[T]], *, timeout: float = ..., interval: float = ..., message: str = ...
) -> T: ...
@overload
async def until(
    predicate: Callable[[], T], *, timeout: float = ..., interval: float = ..., message: str = ...
) -> T: ...
async def until(
    predicate: Callable[[], Any],
    *,
    timeout: float = TIMEOUT,
    interval: float = 0.01,
    message: str = "condition",
) -> Any:
    """`wait_until` for a test running an event loop; `predicate` may return an awaitable."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {message} (last: {value!r})")
        await asyncio.sleep(interval)
