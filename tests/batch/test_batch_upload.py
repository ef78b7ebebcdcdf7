"""Uploads to `POST /v1/files` (and downloads) from hostile clients on raw sockets: too slow, too large, cut
short, gone. Each is answered in OpenAI's shape (or, gone, not at all), its temporary file is
gone, nothing is kept, other uploads and requests go on, and the gauges return to 0."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import httpx
import openai
import pytest

from tests.batches import batch_input
from tests.conftest import Cluster
from tests.wait import until

pytestmark = pytest.mark.e2e  # the router served on loopback in front of fake engines

MakeCluster = Callable[..., AbstractContextManager[Cluster]]
BOUNDARY = "b0undary"
GAUGES = [
    *(("specroute_in_flight_requests", {"pool": p, "backend": f"{p}-1"}) for p in ("fast", "team")),
    *(
        ("specroute_queued_requests", {"pool": p, "job_class": j})
        for p in ("fast", "team")
        for j in ("interactive", "batch")
    ),
]


def _multipart(file: bytes, *, closed: bool = True) -> bytes:
    """A multipart body as the SDK sends it: `purpose`, then the file; `closed=False` leaves out
    the closing boundary."""
    head = (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
        "Content-Type: application/jsonl\r\n\r\n"
    ).encode()
    return head + file + (f"\r\n--{BOUNDARY}--\r\n".encode() if closed else b"")


def _head(length: int | None) -> bytes:
    framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return (
        "POST /v1/files HTTP/1.1\r\nHost: router\r\nAuthorization: Bearer k\r\n"
        f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n{framing}\r\n\r\n"
    ).encode()


async def _answer(reader: asyncio.StreamReader, *, within: float = 30) -> tuple[int, dict[str, Any]]:
    """The status and JSON body of the router's answer."""
    async with asyncio.timeout(within):
        head = await reader.readuntil(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {n.strip().lower(): v.strip() for n, _, v in (line.partition(":") for line in lines if line)}
        body = await reader.readexactly(int(headers["content-length"]))
    return int(status_line.split(" ")[1]), json.loads(body)


def _error(answer: tuple[int, dict[str, Any]], status: int, code: str) -> dict[str, Any]:
    got, body = answer
    assert got == status, body
    error: dict[str, Any] = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["type"], error["code"]) == ("invalid_request_error", code)
    return error


def _store(cluster: Cluster) -> str:
    return os.path.realpath(str(cluster.config["batch"]["store_dir"]))


def _temporary_files(store: str) -> list[str]:
    """Files open in this process (the router runs in it) in the store's directory that have no
    name: uploads on their way in."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith(store + "/") and target.endswith(" (deleted)"):
            found.append(target)
    return found


async def _nothing_left(cluster: Cluster) -> None:
    """No temporary file, nothing but the database in the store, no file kept, gauges at 0, and a
    normal request served."""
    store = _store(cluster)
    await until(lambda: not _temporary_files(store), message="no temporary file open")
    assert all(name.startswith("batches.sqlite3") for name in os.listdir(store)), os.listdir(store)
    client = openai.AsyncOpenAI(base_url=cluster.base_url, api_key="k", max_retries=0, timeout=30)
    assert not [f async for f in client.files.list()]
    for name, labels in GAUGES:
        assert cluster.settled_metric(name, 0, **labels) == 0, (name, labels)
    answer = await client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi"}])
    assert answer.choices[0].message.content
    await client.close()


@pytest.mark.anyio
async def test_a_slow_upload_is_408_while_other_uploads_and_requests_go_on(make_cluster: MakeCluster) -> None:
    with make_cluster(batch={"upload_timeout": 5, "poll_interval": 0.05}) as cluster:
        store = _store(cluster)
        body = _multipart(batch_input(20, prefix="slow"))
        reader, writer = await asyncio.open_connection("127.0.0.1", cluster.router.port)
        writer.write(_head(len(body)) + body[:200])
        await writer.drain()
        await until(lambda: _temporary_files(store), message="the upload's temporary file")
        started = time.monotonic()

        async def dribble() -> None:  # a byte at a time: each arrives, the whole never does (~3 min)
            for byte in body[200:]:
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.05)

        async def answered() -> tuple[tuple[int, dict[str, Any]], float]:
            answer = await _answer(reader, within=60)
            return answer, time.monotonic() - started

        dribbling = asyncio.create_task(dribble())
        answering = asyncio.create_task(answered())
        # Meanwhile another client uploads (while the slow one is held), runs a batch, and chats.
        client = openai.AsyncOpenAI(base_url=cluster.base_url, api_key="k", max_retries=0, timeout=30)
        uploaded = await client.files.create(file=("fine.jsonl", batch_input(5)), purpose="batch")
        assert not answering.done()
        batch = await client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        done = await until(
            lambda: _completed(client, batch.id), message="the other client's batch completed", timeout=30
        )
        assert done.request_counts is not None and done.request_counts.completed == 5
        chat = await client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi"}])
        assert chat.choices[0].message.content

        answer, after = await answering
        error = _error(answer, 408, "body_timeout")
        assert "5 s" in error["message"]
        assert after < 30  # at the upload's deadline, not whenever the body would have ended
        assert not dribbling.done()
        dribbling.cancel()
        writer.close()
        # Only the other client's files are kept: its input, and its batch's output.
        assert {f.filename async for f in client.files.list()} == {"fine.jsonl", f"{batch.id}_output.jsonl"}
        for file_id in (uploaded.id, done.output_file_id):
            await client.files.delete(file_id)
        await client.close()
        await _nothing_left(cluster)


async def _completed(client: openai.AsyncOpenAI, batch_id: str) -> Any:
    batch = await client.batches.retrieve(batch_id)
    return batch if batch.status == "completed" else None


@pytest.mark.anyio
async def test_an_upload_over_the_limit_is_413_before_it_is_all_sent(make_cluster: MakeCluster) -> None:
    limit = 1_000_000
    with make_cluster(batch={"max_file_bytes": limit}) as cluster:
        # Chunked, so the size shows only as it arrives; far more than the limit on offer.
        reader, writer = await asyncio.open_connection("127.0.0.1", cluster.router.port)
        writer.write(_head(None))
        chunk = batch_input(500)
        offered = 256 * 1024 * 1024
        sent = 0

        async def flood() -> None:
            nonlocal sent
            for data in (_multipart(b"", closed=False), *(chunk for _ in range(offered // len(chunk)))):
                writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                await writer.drain()
                sent += len(data)
                # drain() returns at once while the router reads on: let the reader see the answer.
                await asyncio.sleep(0)

        flooding = asyncio.create_task(flood())
        try:
            error = _error(await _answer(reader), 413, "file_too_large")
            assert f"{limit} byte limit" in error["message"]
            # Answered having taken about the limit, while most of the body was still on offer: it
            # was never read whole, into memory or anywhere else.
            assert sent < offered // 4, sent
        finally:
            flooding.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await flooding
            writer.close()  # whatever happened above: a socket left open fails a later test
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
        await _nothing_left(cluster)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("body", "why"),
    [
        (_multipart(batch_input(3), closed=False), "ends before the closing boundary"),
        (_multipart(batch_input(3))[:-40], "ends before the closing boundary"),  # cut inside the file
        (_multipart(b"")[:60], "ends before the closing boundary"),  # cut inside a part's headers
        (b"not multipart at all", "Expected boundary character"),
        (
            _multipart(batch_input(1)).replace(b'name="purpose"', b'name="purpose" ' + b"x" * 9000),
            "",  # a part header over python-multipart's limit
        ),
        (_multipart(batch_input(1)).replace(b"batch\r\n", b"b" * 2000 + b"\r\n"), "over 1024 bytes"),
        (  # headers each within python-multipart's line limit, too many bytes in all
            _multipart(batch_input(1)).replace(
                b'name="purpose"\r\n',
                b'name="purpose"\r\n' + b"".join(b"x-%d: " % i + b"a" * 3000 + b"\r\n" for i in range(3)),
            ),
            "headers are over 8192 bytes",
        ),
    ],
)
async def test_a_malformed_or_truncated_multipart_body_is_400(make_cluster: MakeCluster, body: bytes, why: str) -> None:
    with make_cluster() as cluster:
        reader, writer = await asyncio.open_connection("127.0.0.1", cluster.router.port)
        writer.write(_head(len(body)) + body)
        await writer.drain()
        error = _error(await _answer(reader), 400, "invalid_multipart")
        assert why in error["message"]
        writer.close()
        await _nothing_left(cluster)


@pytest.mark.anyio
async def test_a_client_that_leaves_mid_upload_leaves_nothing(make_cluster: MakeCluster) -> None:
    with make_cluster() as cluster:
        store = _store(cluster)
        body = _multipart(batch_input(200))
        _, writer = await asyncio.open_connection("127.0.0.1", cluster.router.port)
        writer.write(_head(len(body)) + body[: len(body) // 2])
        await writer.drain()
        await until(lambda: _temporary_files(store), message="the upload's temporary file")
        writer.close()
        await writer.wait_closed()
        await _nothing_left(cluster)


@pytest.mark.parametrize(
    "files",
    [
        {"other": ("a.jsonl", batch_input(1))},  # no part named `file`
        [("file", ("a.jsonl", batch_input(1))), ("file", ("b.jsonl", batch_input(1)))],  # two files
    ],
)
def test_a_file_part_named_otherwise_or_a_second_file_is_400(make_cluster: MakeCluster, files: Any) -> None:
    with make_cluster() as cluster:
        answer = httpx.post(cluster.base_url + "/files", data={"purpose": "batch"}, files=files)
        assert answer.status_code == 400
        error = answer.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] in ("missing_file", "invalid_multipart")
        asyncio.run(_nothing_left(cluster))


def _big_file(megabytes: int) -> bytes:
    line = batch_input(1)
    filler = "x" * 4000
    rows = (
        line.replace(b'"r-0"', f'"r-{i}"'.encode(), 1).replace(b'"r-0"', f'"{i} {filler}"'.encode())
        for i in range(megabytes * 250)
    )
    return b"".join(rows)


@pytest.mark.anyio
async def test_a_download_is_whole_though_the_file_is_deleted_meanwhile_and_leaves_nothing(
    make_cluster: MakeCluster,
) -> None:
    with make_cluster() as cluster:
        store = _store(cluster)
        content = _big_file(16)  # more than the sockets between hold: the router waits on the reader
        client = openai.AsyncOpenAI(base_url=cluster.base_url, api_key="k", max_retries=0, timeout=60)
        uploaded = await client.files.create(file=("big.jsonl", content), purpose="batch")
        reader, writer = await asyncio.open_connection("127.0.0.1", cluster.router.port)
        writer.write(
            f"GET /v1/files/{uploaded.id}/content HTTP/1.1\r\nHost: router\r\nAuthorization: Bearer k\r\n\r\n".encode()
        )
        async with asyncio.timeout(30):
            head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and f"content-length: {len(content)}".encode() in head.lower()
        await until(lambda: _temporary_files(store), message="the download's copy")
        assert (await client.files.delete(uploaded.id)).deleted  # while it is being read
        async with asyncio.timeout(60):
            assert await reader.readexactly(len(content)) == content
        writer.close()

        # A client that leaves halfway: the copy is closed all the same.
        again = await client.files.create(file=("big.jsonl", content), purpose="batch")
        reader, writer = await asyncio.open_connection("127.0.0.1", cluster.router.port)
        writer.write(
            f"GET /v1/files/{again.id}/content HTTP/1.1\r\nHost: router\r\nAuthorization: Bearer k\r\n\r\n".encode()
        )
        async with asyncio.timeout(30):
            await reader.readexactly(1024 * 1024)
        await until(lambda: _temporary_files(store), message="the download's copy")
        writer.close()
        await client.files.delete(again.id)
        await client.close()
        await _nothing_left(cluster)


@pytest.mark.anyio
async def test_uploads_at_once_each_keep_their_own_content(make_cluster: MakeCluster) -> None:
    with make_cluster() as cluster:
        client = openai.AsyncOpenAI(base_url=cluster.base_url, api_key="k", max_retries=0, timeout=60)
        contents = [batch_input(200 + i, prefix=f"u{i}") for i in range(8)]
        uploaded = await asyncio.gather(
            *(client.files.create(file=(f"u{i}.jsonl", content), purpose="batch") for i, content in enumerate(contents))
        )
        for file, content in zip(uploaded, contents, strict=True):
            assert file.bytes == len(content)
            assert (await client.files.content(file.id)).content == content
            await client.files.delete(file.id)
        await client.close()
        await _nothing_left(cluster)


class _Sampler:
    """Watches, from a thread, for a temporary file in the store while a test's exchange runs:
    one seen at any moment is kept."""

    def __init__(self, store: str) -> None:
        self._store = store
        self.seen: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.seen += _temporary_files(self._store)
            self._stop.wait(0.001)


@pytest.mark.anyio
async def test_an_upload_the_store_has_no_room_for_is_413_before_it_reaches_the_disk(
    make_cluster: MakeCluster,
) -> None:
    filler = batch_input(2000, prefix="filler")
    room = 100_000
    with make_cluster(batch={"max_storage_bytes": len(filler) + room}) as cluster:
        store = _store(cluster)
        other = openai.AsyncOpenAI(base_url=cluster.base_url, api_key="other", max_retries=0, timeout=30)
        kept = await other.files.create(file=("filler.jsonl", filler), purpose="batch")  # the store nearly full
        too_big = _multipart(batch_input(5000, prefix="big"))  # far under max_file_bytes, over the room left

        # Declared too large: 413 with only the head sent, no temporary file ever made.
        with _Sampler(store) as sampler:
            reader, writer = await asyncio.open_connection("127.0.0.1", cluster.router.port)
            writer.write(_head(len(too_big)) + too_big[:100])
            await writer.drain()
            error = _error(await _answer(reader, within=10), 413, "storage_full")
            assert error["param"] == "file" and f"{room} bytes left" in error["message"]
            # The connection ends cleanly: the router closes it rather than read the rest as a request.
            async with asyncio.timeout(10):
                assert await reader.read() == b""
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
        assert not sampler.seen, sampler.seen

        # Chunked: the size shows only as it arrives; 413 once it passes the room, the rest unread.
        reader, writer = await asyncio.open_connection("127.0.0.1", cluster.router.port)
        writer.write(_head(None))
        offered = 64 * 1024 * 1024
        sent = 0

        async def flood() -> None:
            nonlocal sent
            piece = batch_input(200)
            for data in (_multipart(b"", closed=False), *(piece for _ in range(offered // len(piece)))):
                writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                await writer.drain()
                sent += len(data)
                await asyncio.sleep(0)  # let the reader see the answer when it comes

        flooding = asyncio.create_task(flood())
        try:
            _error(await _answer(reader), 413, "storage_full")
            assert sent < offered // 4, sent
        finally:
            flooding.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await flooding
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
        await _nothing_left(cluster)  # its temporary file gone, gauges at 0, chat served

        # An upload that fits is taken.
        client = openai.AsyncOpenAI(base_url=cluster.base_url, api_key="k", max_retries=0, timeout=30)
        fits = batch_input(100)
        taken = await client.files.create(file=("fits.jsonl", fits), purpose="batch")
        assert (await client.files.content(taken.id)).content == fits
        await client.files.delete(taken.id)
        await other.files.delete(kept.id)
        await client.close()
        await other.close()
        await _nothing_left(cluster)


@pytest.mark.anyio
async def test_copies_of_files_being_read_are_bounded_by_the_storage_limit(make_cluster: MakeCluster) -> None:
    # A download reads a copy of the file made for it. Downloads left unread must not make the
    # router write a copy of the same file for each: they are bounded, 503 past it, as a new
    # batch's copy of its input is.
    content = _big_file(16)  # more than the sockets between hold: the router waits on the reader
    with make_cluster(batch={"max_storage_bytes": 2 * len(content) + len(content) // 2}) as cluster:
        store = _store(cluster)
        client = openai.AsyncOpenAI(base_url=cluster.base_url, api_key="k", max_retries=0, timeout=60)
        uploaded = await client.files.create(file=("big.jsonl", content), purpose="batch")
        get = f"GET /v1/files/{uploaded.id}/content HTTP/1.1\r\nHost: router\r\nAuthorization: Bearer k\r\n\r\n"

        async def download() -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
            reader, writer = await asyncio.open_connection("127.0.0.1", cluster.router.port)
            writer.write(get.encode())
            async with asyncio.timeout(30):
                head = await reader.readuntil(b"\r\n\r\n")
            return reader, writer, head

        async def copies_bytes() -> int:
            async with httpx.AsyncClient() as http:
                status = await http.get(cluster.router.url + "/router/status")
            return int(status.json()["batches"]["copies_bytes"])

        held = [await download() for _ in range(2)]  # their heads read, their bodies not
        assert all(head.startswith(b"HTTP/1.1 200") for _, _, head in held)
        assert await copies_bytes() == 2 * len(content)
        reader, writer, head = await download()
        assert head.startswith(b"HTTP/1.1 503") and b"retry-after" in head.lower()
        body = json.loads(await reader.readexactly(int(head.lower().split(b"content-length: ")[1].split(b"\r")[0])))
        assert body["error"]["code"] == "batch_copies_full", body
        writer.close()
        with pytest.raises(openai.InternalServerError) as caught:
            await client.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
        assert caught.value.status_code == 503 and caught.value.code == "batch_copies_full"
        assert not cluster.team.requests and not (await client.batches.list()).data

        held.pop()[1].close()  # a reader leaves: its copy is closed, and another may be made

        async def whole_download() -> bool:
            reader, writer, head = await download()
            try:
                if not head.startswith(b"HTTP/1.1 200"):
                    return False
                async with asyncio.timeout(60):
                    assert await reader.readexactly(len(content)) == content
                return True
            finally:
                writer.close()

        await until(whole_download, message="a download once a copy was closed")
        held.pop()[1].close()
        await until(lambda: not _temporary_files(store), message="no copy left open")

        async def no_copies() -> bool:
            return await copies_bytes() == 0

        await until(no_copies, message="every copy given back")
        batch = await client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert batch.status == "validating"
        await client.batches.cancel(batch.id)  # 4,000 lines: not to be run here
        await client.close()
