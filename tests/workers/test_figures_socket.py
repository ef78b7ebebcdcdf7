"""The workers' shared figures over their Unix socket (router.workers.store), with one worker
sending what a buggy one may: the supervisor's end served in the test's event loop, the buggy
worker a raw socket, the other worker the `SocketStore` a worker uses."""

from __future__ import annotations

import asyncio
import json
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from router.backends.engines import Elsewhere
from router.replicas.store import Ask
from router.workers.figures import Figures
from router.workers.store import SocketStore, serve_figures


@pytest.fixture
async def socket_path() -> AsyncIterator[str]:
    with tempfile.TemporaryDirectory(prefix="specroute-figures-") as run:
        path = str(Path(run) / "figures.sock")
        server = await serve_figures(path, Figures(memory=60.0, max_clients=100, clock=lambda: 0.0))
        async with server:
            yield path


async def _call(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, line: bytes) -> bytes:
    writer.write(line + b"\n")
    return await reader.readline()


@pytest.mark.anyio
@pytest.mark.parametrize(
    "line",
    [
        b'[1,"ended",{},{},{"b":"x"},{}]',
        b'[1,"sync",{},{"b":["x",0]},{}]',
        b'[1,"sync",{},{"b":[1,NaN]},{}]',
        b'[1,"sync",{},{"b":[1.5,0]},{}]',
        b'[1,"sync",{},{"b":[1,0]},{"b":null}]',
        b'[1,"claim",[["b",1e400,3,"c",1,false]]]',
        b'[1,"claim",[["b",' + b"9" * 400 + b',3,"c",1,false]]]',
    ],
    ids=["ended-text", "sync-text", "sync-nan", "sync-float", "held-null", "claim-infinity", "claim-huge-int"],
)
async def test_a_call_of_counts_that_are_no_counts_leaves_the_other_worker_served(
    socket_path: str, line: bytes
) -> None:
    buggy = await asyncio.open_unix_connection(socket_path)
    assert json.loads(await _call(*buggy, b'[0,"claim",[["b",0,2,"c",1,false]]]'))[1] == [[True, 0, 1]]
    other = SocketStore(socket_path)
    try:
        answer = await _call(*buggy, line)
        # The other worker's calls are answered, in counts: the buggy worker's call was refused,
        # its connection closed and its figures (its slot) forgotten.
        claims = await other.claim([Ask("b", 0, 3, "c", 1)])
        assert [c.granted for c in claims.claims] == [True]
        assert claims.backends == {}
        view = await other.sync({"c": 1}, {"b": Elsewhere(1, 0)})
        assert view.replicas == 0 and view.backends == {}
        assert answer == b""
    finally:
        buggy[1].close()
        await other.aclose()


@pytest.mark.anyio
async def test_a_call_nested_past_the_parsers_depth_is_refused_and_said_as_any_other(
    socket_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    buggy = await asyncio.open_unix_connection(socket_path)
    try:
        assert await _call(*buggy, b"[" * 200_000 + b"]" * 200_000) == b""
    finally:
        buggy[1].close()
    refused = [r for r in caplog.records if r.name == "specroute.workers" and "RecursionError" in r.getMessage()]
    assert len(refused) == 1, caplog.text[-500:]
