"""dnspython's resolver as the router uses it (router.backends.nameservers): a query cancelled at
any point (a name's `discovery.timeout`, the router stopping) leaves no socket open, on uvloop as
the router runs and on asyncio's own loop. uvloop left the UDP transport of a query cancelled
while it was being made to the garbage collector: an unclosed-resource ResourceWarning that
failed whatever test was running when it was collected."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import warnings

import pytest
import uvloop

from router.backends.discovery import ResolveError
from router.backends.nameservers import DnsResolver
from tests.servers import free_port


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_query_cancelled_at_any_step_leaves_no_socket_open(loop: str) -> None:
    # Nothing listens there: the query fails on its own if it is not cancelled first.
    resolver = DnsResolver([("127.0.0.1", free_port())], timeout=5, limit=8)

    async def cancelled_after(steps: int) -> None:
        query = asyncio.ensure_future(resolver.addresses("spec.test", 80))
        for _ in range(steps):  # each step a loop iteration: the first ones are the socket's making
            await asyncio.sleep(0)
        query.cancel()
        with contextlib.suppress(asyncio.CancelledError, ResolveError):
            await query

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for steps in range(8):
            (uvloop.run if loop == "uvloop" else asyncio.run)(cancelled_after(steps))
            gc.collect()  # what was left open is reported as it is collected
    assert [str(w.message) for w in seen if issubclass(w.category, ResourceWarning)] == []
