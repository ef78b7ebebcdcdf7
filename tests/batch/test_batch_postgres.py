"""The Batch API on the PostgreSQL store (`batch.store: postgres`), against a real PostgreSQL
server (tests/postgres.py): the whole cycle with the official `openai` SDK; two routers, each its
own process, sharing one database, one of them killed (SIGKILL) in the middle of a batch; a
database that cannot be reached; and the DSN's password kept out of every answer and log."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import io
import json
import logging
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import openai
import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from router.batch.postgres import PostgresStore
from router.batch.sqlite import SqliteStore
from router.batch.store import BatchRecord, FileRecord, StorageFull, Store
from router.cli import main as cli
from router.config import Settings
from tests.batch.test_batch import FAST, _finished, _jsonl
from tests.batches import batch_input, router_config
from tests.conftest import Cluster, settings_data
from tests.fake_engine import FakeEngine
from tests.postgres import PASSWORD, PostgresServer
from tests.servers import ServerThread, free_port, serve
from tests.wait import wait_until

DSN_ENV = "BATCH_TEST_POSTGRES_DSN"  # not SPECROUTE_*: the routers in their own processes get it
KEYS_ENV = "BATCH_TEST_CLIENT_KEYS"


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    with PostgresServer() as server:
        yield server


@pytest.fixture
def dsn(postgres: PostgresServer, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh database for the test, its DSN in `DSN_ENV`."""
    url = postgres.database("t_" + uuid.uuid4().hex[:12])
    monkeypatch.setenv(DSN_ENV, url)
    return url


def _store(**more: Any) -> dict[str, Any]:
    return {**FAST, "store": "postgres", "postgres_dsn_env": DSN_ENV, **more}


@pytest.mark.e2e
def test_whole_cycle_with_the_sdk_on_postgres(
    dsn: str, monkeypatch: pytest.MonkeyPatch, make_cluster: Callable[..., AbstractContextManager[Cluster]]
) -> None:
    monkeypatch.setenv(KEYS_ENV, "alice-key,bob-key")
    with make_cluster(auth={"client_keys_env": KEYS_ENV}, batch=_store()) as cluster:
        alice = cluster.client("alice-key")
        bob = cluster.client("bob-key")
        # A file of several chunks (1 MiB each) comes back byte for byte.
        big = batch_input(12_000, prefix="big")
        assert len(big) > 2 * 1024 * 1024
        stored = alice.files.create(file=("big.jsonl", big), purpose="batch")
        assert stored.bytes == len(big) and alice.files.content(stored.id).content == big
        with psycopg.connect(dsn) as db:
            chunks = db.execute("SELECT COUNT(*) FROM specroute_file_chunks WHERE file_id = %s", (stored.id,))
            assert chunks.fetchone() == (len(big) // (1024 * 1024) + 1,)
        assert alice.files.delete(stored.id).deleted

        content = batch_input(20) + batch_input(1, prefix="bad", model="no-such-model")
        uploaded = alice.files.create(file=("input.jsonl", content), purpose="batch")
        batch = alice.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"k": "v"}
        )
        assert batch.status == "validating" and batch.metadata == {"k": "v"}
        for attempt in (
            lambda: bob.batches.retrieve(batch.id),
            lambda: bob.batches.cancel(batch.id),
            lambda: bob.files.content(uploaded.id),
        ):
            with pytest.raises(openai.NotFoundError):
                attempt()
        done = _finished(alice, batch.id)
        assert done.status == "completed" and done.completed_at and done.in_progress_at and done.finalizing_at
        assert done.request_counts is not None
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (21, 20, 1)
        assert done.output_file_id and done.error_file_id
        output = _jsonl(alice.files.content(done.output_file_id).content)
        assert sorted(row["custom_id"] for row in output) == sorted(f"r-{i}" for i in range(20))
        assert all(row["response"]["status_code"] == 200 and row["error"] is None for row in output)
        errors = _jsonl(alice.files.content(done.error_file_id).content)
        assert [(row["custom_id"], row["response"]["status_code"]) for row in errors] == [("bad-0", 404)]
        assert len(cluster.team.requests) == 21  # each line sent once
        assert [b.id for b in alice.batches.list().data] == [batch.id] and not bob.batches.list().data

        # Cancel: the lines done are kept, the others are in the error file as batch_cancelled.
        cluster.team.token_delay = 0.05
        slow = alice.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
        wait_until(lambda: alice.batches.retrieve(slow.id).status == "in_progress", message="the batch started")
        assert alice.batches.cancel(slow.id).status == "cancelling"
        cancelled = _finished(alice, slow.id)
        assert cancelled.status == "cancelled" and cancelled.request_counts is not None
        assert cancelled.request_counts.completed < 20 and cancelled.error_file_id

        status = httpx.get(cluster.router.url + "/router/status").json()["batches"]
        assert status["store"] == f"postgres (DSN in ${DSN_ENV})" and status["by_status"]["cancelled"] == 1
    with psycopg.connect(dsn) as db:  # it is all in the database, none of it on disk
        assert db.execute("SELECT COUNT(*) FROM specroute_batches").fetchone() == (2,)
    assert not list(Path(cluster.config["batch"]["store_dir"]).glob("*"))


def _lines_done(url: str) -> float:
    """`specroute_batch_lines_total`, answered or failed, as a router process exports it."""
    families = text_string_to_metric_families(httpx.get(url + "/metrics").text)
    return sum(
        s.value for f in families if f.name == "specroute_batch_lines" for s in f.samples if s.name.endswith("_total")
    )


LINES = 200
CONCURRENCY = 8  # the engine's slots in each router's settings
IN_FLIGHT = 6  # batch.max_concurrency: lines a router has between sending one and recording it


@pytest.mark.e2e
def test_two_routers_share_one_postgres_store_and_one_is_killed(
    dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two routers, each its own process, run one 200-line batch from one database. While both
    run, no line is sent twice; one is killed with SIGKILL, and the other finishes the batch once
    the dead one's leases have run out: every custom_id answered exactly once."""
    monkeypatch.setenv(KEYS_ENV, "alice-key,bob-key")
    engine = FakeEngine(token_delay=0.1)  # 4 tokens: 0.4 s a line; in this process, it outlives the routers
    with ServerThread(engine.app()) as server, contextlib.ExitStack() as stack:
        configs = [
            router_config(
                tmp_path / name,
                server.url,
                slots=CONCURRENCY,
                auth={"client_keys_env": KEYS_ENV},
                batch=_store(store_dir=str(tmp_path / name / "spool"), lease_seconds=3.0, max_concurrency=IN_FLIGHT),
            )
            for name in ("a", "b")
        ]
        (first, first_url), (_, second_url) = (stack.enter_context(serve(config)) for config in configs)
        alice = stack.enter_context(openai.OpenAI(base_url=first_url + "/v1", api_key="alice-key", max_retries=0))
        uploaded = alice.files.create(file=("lines.jsonl", batch_input(LINES, max_tokens=4)), purpose="batch")
        batch = alice.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        # Another key's batch is not found on either router.
        for url in (first_url, second_url):
            with pytest.raises(openai.NotFoundError), openai.OpenAI(base_url=url + "/v1", api_key="bob-key") as bob:
                bob.batches.retrieve(batch.id)

        wait_until(
            lambda: _lines_done(first_url) >= 10 and _lines_done(second_url) >= 10,
            timeout=60,
            message="both routers answered lines",
        )
        first.send_signal(signal.SIGKILL)
        first.wait()
        sent_before = collections.Counter(seen.body["messages"][0]["content"] for seen in list(engine.requests))
        # While both ran, no line was sent by both.
        assert set(sent_before.values()) == {1}, sent_before.most_common(3)
        assert len(sent_before) < LINES, "the batch was over before the kill"

        second = stack.enter_context(openai.OpenAI(base_url=second_url + "/v1", api_key="alice-key", max_retries=0))
        done = _finished(second, batch.id, timeout=90)
        assert done.status == "completed" and done.output_file_id is not None
        output = _jsonl(second.files.content(done.output_file_id).content)

    answered = collections.Counter(row["custom_id"] for row in output)
    assert answered == collections.Counter(f"r-{i}" for i in range(LINES))  # each exactly once
    assert all(row["response"]["status_code"] == 200 for row in output)
    assert done.request_counts is not None and (done.request_counts.completed, done.request_counts.failed) == (LINES, 0)
    sent = collections.Counter(seen.body["messages"][0]["content"] for seen in engine.requests)
    assert set(sent) == set(answered)
    # Sent twice: only lines the killed router had in flight (sent, not recorded), taken again
    # by the other once their lease ran out.
    again = [line for line, times in sent.items() if times > 1]
    assert all(sent[line] == 2 and sent_before[line] == 1 for line in again)
    assert len(again) <= IN_FLIGHT


class _Relay:
    """A TCP relay on a loopback port to the database, to open and cut: the database as a
    router on another host sees it when the network between them fails."""

    def __init__(self, target: int) -> None:
        self.port = 0
        self._target = target
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()

    def _run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=10)

    def open(self, port: int) -> None:
        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            writer.close()

        async def relay(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
            reader, writer = await asyncio.open_connection("127.0.0.1", self._target)
            self._writers |= {client_writer, writer}
            await asyncio.gather(pipe(client_reader, writer), pipe(reader, client_writer))

        async def start() -> None:
            self._server = await asyncio.start_server(relay, "127.0.0.1", port)

        self._run(start())

    def cut(self) -> None:
        """Stop listening and drop every connection, as a network failure does."""

        async def stop() -> None:
            if self._server is not None:
                self._server.close()
                await self._server.wait_closed()
            for writer in self._writers:
                writer.close()
            self._writers.clear()

        self._run(stop())

    def close(self) -> None:
        self.cut()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


@pytest.mark.e2e
def test_a_database_out_of_reach_is_503_and_live_traffic_is_served(
    postgres: PostgresServer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    make_cluster: Callable[..., AbstractContextManager[Cluster]],
) -> None:
    """Nothing listens where the DSN points: the Batch API answers 503 (OpenAI's shape), the
    router stays ready and serves live requests, and once the database can be reached, the store
    opens by itself. Then the database goes out of reach in the middle of a batch: 503 again, and
    once it is back the batch completes, each line answered once. The password is in no answer
    and no log line."""
    database = "t_" + uuid.uuid4().hex[:12]
    postgres.database(database)
    relay = _Relay(postgres.port)
    port = free_port()
    monkeypatch.setenv(DSN_ENV, postgres.dsn(database, port=port))
    caplog.set_level(logging.DEBUG)
    try:
        with make_cluster(batch=_store(lease_seconds=1.0, max_concurrency=2)) as cluster:
            answer = httpx.get(cluster.base_url + "/batches")
            assert answer.status_code == 503 and answer.headers["retry-after"]
            error = answer.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["code"] == "batch_store_unavailable"
            assert httpx.get(cluster.router.url + "/readyz").status_code == 200
            client = cluster.client("none")
            assert client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi"}])
            status = httpx.get(cluster.router.url + "/router/status").json()["batches"]
            assert status["store"] is None and DSN_ENV in status["store_error"]

            relay.open(port)  # the database comes within reach: the store opens on its own
            uploaded = wait_until(
                lambda: _try(lambda: client.files.create(file=("a.jsonl", batch_input(20)), purpose="batch")),
                timeout=30,
                interval=0.2,
                message="the store opened",
            )
            cluster.team.token_delay = 0.05  # 0.2 s a line, two at a time
            batch = client.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 2)  # type: ignore[union-attr]
            relay.cut()
            with pytest.raises(openai.APIStatusError) as caught:
                client.batches.retrieve(batch.id)
            assert caught.value.status_code == 503 and caught.value.code == "batch_store_unavailable"
            assert client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi"}])
            relay.open(port)
            done = _finished(client, batch.id, timeout=60)
            assert done.status == "completed" and done.request_counts is not None
            assert (done.request_counts.completed, done.request_counts.failed) == (20, 0)
            output = _jsonl(client.files.content(done.output_file_id).content)
            assert sorted(row["custom_id"] for row in output) == sorted(f"r-{i}" for i in range(20))
            texts = [answer.text, json.dumps(status), caught.value.response.text]
    finally:
        relay.close()
    assert all(PASSWORD not in text for text in texts)
    assert PASSWORD not in caplog.text and "batch store not opened" in caplog.text


def _try(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except openai.APIStatusError as exc:
        if exc.status_code != 503:
            raise
        return None


@pytest.mark.e2e
def test_the_dsn_is_never_shown(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    make_cluster: Callable[..., AbstractContextManager[Cluster]],
) -> None:
    """Not in check-config, nor the status page, nor the log, even when the DSN is malformed
    (the driver's own message quotes it whole)."""
    monkeypatch.setenv(DSN_ENV, f"postgresql//specroute:{PASSWORD}@127.0.0.1/db")
    caplog.set_level(logging.DEBUG)
    config = tmp_path / "router.yaml"
    config.write_text(json.dumps(settings_data("http://127.0.0.1:9", "http://127.0.0.1:9", batch=_store())))
    assert cli(["check-config", str(config)]) == 0
    printed = capsys.readouterr().out
    assert json.loads(printed)["batch"]["postgres_dsn_env"] == f"{DSN_ENV} (set)"
    with make_cluster(batch=_store()) as cluster:
        answer = httpx.get(cluster.base_url + "/files")
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "batch_store_unavailable"
        status = httpx.get(cluster.router.url + "/router/status").text
    assert "not a PostgreSQL connection string" in status
    for text in (printed, answer.text, status, caplog.text):
        assert PASSWORD not in text


@pytest.fixture(params=["sqlite", "postgres"])
def either_store(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The `batch` settings of a router on SQLite, or on PostgreSQL (a fresh database)."""
    if request.param == "sqlite":
        return FAST
    request.getfixturevalue("dsn")
    return _store()


# Ids no router makes: a NUL (PostgreSQL's text holds none), 10 kB, a path, an injection, unicode.
HOSTILE_IDS = ["\x00", "file-\x00", "a" * 10_000, "../../etc/passwd", "file-' OR '1'='1", "\u202e", "😀", "\xff"]


@pytest.mark.e2e
def test_hostile_ids_names_and_limits_are_answered_on_either_store(
    either_store: dict[str, Any], make_cluster: Callable[..., AbstractContextManager[Cluster]]
) -> None:
    """Whatever a client puts in an id, a cursor, a purpose, a limit or a file name: 404, an
    empty page or 400, in OpenAI's shape, never a 500; the client's own things untouched."""
    with make_cluster(batch=either_store) as cluster:
        client = cluster.client("alice-key")
        mine = client.files.create(file=("a.jsonl", batch_input(2)), purpose="batch")
        batch = client.batches.create(input_file_id=mine.id, endpoint="/v1/chat/completions", completion_window="24h")
        with httpx.Client(base_url=cluster.base_url, headers={"authorization": "Bearer alice-key"}) as http:
            for hostile in HOSTILE_IDS:
                name = quote(hostile, safe="")
                for method, path in (
                    ("GET", f"/files/{name}"),
                    ("GET", f"/files/{name}/content"),
                    ("DELETE", f"/files/{name}"),
                    ("GET", f"/batches/{name}"),
                    ("POST", f"/batches/{name}/cancel"),
                ):
                    answer = http.request(method, path)
                    assert answer.status_code == 404, (method, path[:40], answer.text[:200])
                    assert set(answer.json()["error"]) == {"message", "type", "param", "code"}
                params = {"input_file_id": hostile, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
                answer = http.post("/batches", json=params)
                assert answer.status_code == 404 and answer.json()["error"]["code"] == "file_not_found", answer.text
                for path, query in (("/files", "after"), ("/files", "purpose"), ("/batches", "after")):
                    answer = http.get(path, params={query: hostile})
                    assert answer.status_code == 200, (path, query, answer.text[:200])
                    assert answer.json()["object"] == "list"
            for path in ("/files", "/batches"):
                for limit in ("²", "0", "-1", "1e3", ""):
                    answer = http.get(path, params={"limit": limit})
                    assert answer.status_code == 400 and answer.json()["error"]["param"] == "limit", answer.text
            # A file name as raw bytes, NUL and all: kept, without the NUL.
            raw = (
                b'--zz\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
                b'--zz\r\nContent-Disposition: form-data; name="file"; filename="a\x00\xff.jsonl"\r\n\r\n'
                + batch_input(1)
                + b"\r\n--zz--\r\n"
            )
            answer = http.post("/files", content=raw, headers={"content-type": "multipart/form-data; boundary=zz"})
            assert answer.status_code == 200, answer.text
            assert answer.json()["filename"] == "a\ufffd\xff.jsonl"
            # A custom_id or model holding a NUL is a bad line, on either store.
            for row in ({"custom_id": "a\x00"}, {"custom_id": "a", "body": {"model": "m\x00"}}):
                line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}, **row}
                files = {"file": ("n.jsonl", json.dumps(line).encode() + b"\n")}
                answer = http.post("/files", data={"purpose": "batch"}, files=files)
                assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_file", answer.text
                assert "U+0000" in answer.json()["error"]["message"]
        assert {f.id for f in client.files.list()} >= {mine.id}
        assert client.files.content(mine.id).content == batch_input(2)
        assert _finished(client, batch.id).status == "completed"


def test_the_postgres_store_needs_its_dsn_env() -> None:
    with pytest.raises(ValidationError, match="postgres_dsn_env"):
        Settings(**settings_data("http://127.0.0.1:9", "http://127.0.0.1:9", batch={"store": "postgres"}))


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.e2e)])  # e2e: a real PostgreSQL
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Store, Store]]:
    """Two handles on one store, as two routers have: one SQLite file, or one PostgreSQL database."""
    if request.param == "sqlite":
        pair: tuple[Store, Store] = (SqliteStore(tmp_path, clock=time.time), SqliteStore(tmp_path, clock=time.time))
    else:
        url = request.getfixturevalue("postgres").database("t_" + uuid.uuid4().hex[:12])
        pair = (
            PostgresStore(url, spool_dir=tmp_path, clock=time.time),
            PostgresStore(url, spool_dir=tmp_path, clock=time.time),
        )
    yield pair
    for store in pair:
        store.close()


def _batch_record(batch_id: str, total: int) -> BatchRecord:
    now = int(time.time())
    return BatchRecord(
        id=batch_id, owner="o", status="in_progress", endpoint="/v1/chat/completions", input_file_id="file-in",
        completion_window="24h", model=None, metadata=None, errors=None, created_at=now, expires_at=now + 3600,
        total=total,
    )  # fmt: skip


def test_both_stores_keep_the_same_promises(stores: tuple[Store, Store]) -> None:
    """The store interface, on SQLite and on PostgreSQL alike: a line is held by one router at a
    time, taken over once its lease lapses, recorded once; files come back whole."""
    first, second = stores
    first.create_batch(
        _batch_record("b1", 10), ((f"c{i}", "/v1/chat/completions", "{}") for i in range(10)), limit=10**9
    )
    now = time.time()
    taken = first.claim("b1", "A", 4, now=now, until=now + 60)
    other = second.claim("b1", "B", 10, now=now, until=now + 0.5)
    assert [line.idx for line in taken] == [0, 1, 2, 3] and [line.idx for line in other] == list(range(4, 10))
    assert not first.claim("b1", "C", 10, now=now, until=now + 60)  # every line is held
    # B's leases lapse (it died): its lines are taken again, A's are not.
    again = wait_until(
        lambda: first.claim("b1", "C", 10, now=time.time(), until=time.time() + 60), message="B's leases lapsed"
    )
    assert [line.idx for line in again] == list(range(4, 10))
    # Each line is recorded once, whoever answers it; a line answered twice is recorded once.
    assert all(first.record(line, {"line": line.custom_id}, failed=False) for line in taken)
    assert [second.record(line, {"line": line.custom_id}, failed=line.idx == 9) for line in other] == [True] * 6
    assert not any(first.record(line, {"again": True}, failed=False) for line in again)
    assert first.pending("b1") == 0
    first.finish("b1", "completed", int(now), output_id="file-out", error_id="file-err")
    second.finish("b1", "completed", int(now), output_id="file-out2", error_id="file-err2")  # already done
    done = second.get_batch("o", "b1")
    assert done is not None and (done.status, done.completed, done.failed) == ("completed", 9, 1)
    assert (done.output_file_id, done.error_file_id) == ("file-out", "file-err")
    out = io.BytesIO()
    assert second.copy_file("o", "file-out", out)
    assert [json.loads(row)["line"] for row in out.getvalue().splitlines()] == [f"c{i}" for i in range(9)]
    # A file comes back byte for byte; over the storage limit, nothing is kept.
    content = bytes(range(256)) * 9000  # 2.3 MB: three chunks in PostgreSQL
    first.add_file(FileRecord("file-x", "o", "x.jsonl", "batch", len(content), 1), io.BytesIO(content), limit=10**9)
    copy = io.BytesIO()
    assert second.copy_file("o", "file-x", copy) and copy.getvalue() == content
    assert not second.copy_file("someone-else", "file-x", io.BytesIO())
    with pytest.raises(StorageFull):
        first.add_file(
            FileRecord("file-y", "o", "y", "batch", len(content), 2), io.BytesIO(content), limit=len(content)
        )
    assert second.get_file("o", "file-y") is None
    assert second.delete_file("o", "file-x") and not second.copy_file("o", "file-x", io.BytesIO())


def test_the_storage_used_counts_every_line_result_and_file(stores: tuple[Store, Store]) -> None:
    """What `max_storage_bytes` bounds, on both stores: a batch's copy of its lines (in bytes, not
    characters) and its results while it runs, its output and error files once it is done."""
    first, second = stores
    assert first.used_bytes() == 0
    body = '{"q":"été"}'  # two of its characters take two bytes each
    first.create_batch(_batch_record("b9", 2), ((f"c{i}", "/v1/chat/completions", body) for i in range(2)), limit=10**9)
    copy = sum(len(f"c{i}") + len("/v1/chat/completions") + len(body.encode()) for i in range(2))
    assert first.used_bytes() == second.used_bytes() == copy
    now = time.time()
    taken = first.claim("b9", "A", 2, now=now, until=now + 60)
    assert first.record(taken[0], {"line": "c0"}, failed=False)
    assert second.used_bytes() == copy + len(json.dumps({"line": "c0"}, separators=(",", ":")))
    first.finish("b9", "completed", int(now), output_id="file-o9", error_id="file-e9")
    output, errors = second.get_file("o", "file-o9"), second.get_file("o", "file-e9")
    assert output is not None and errors is not None  # the line not answered is in the error file
    assert first.used_bytes() == second.used_bytes() == output.bytes + errors.bytes  # the lines' copies are gone


def test_a_batch_past_the_storage_limit_is_refused_whole(stores: tuple[Store, Store]) -> None:
    """A batch's copy of its lines counts as it goes in: past `limit`, StorageFull and nothing kept."""
    first, second = stores
    lines = [(f"c{i}", "/v1/chat/completions", '{"q":"été"}') for i in range(3)]
    copy = sum(len(c) + len(u) + len(b.encode()) for c, u, b in lines)
    first.create_batch(_batch_record("b4", 3), lines, limit=2 * copy)
    with pytest.raises(StorageFull):
        second.create_batch(_batch_record("b5", 3), lines, limit=2 * copy - 1)
    assert first.get_batch("o", "b5") is None and first.used_bytes() == copy
    second.create_batch(_batch_record("b5", 3), lines, limit=2 * copy)  # exactly at the limit
    assert first.used_bytes() == 2 * copy and second.pending("b5") == 3


def test_a_line_put_back_waits_and_a_released_line_is_taken_at_once(stores: tuple[Store, Store]) -> None:
    first, second = stores
    first.create_batch(_batch_record("b2", 2), ((f"c{i}", "/v1/chat/completions", "{}") for i in range(2)), limit=10**9)
    now = time.time()
    one, _ = first.claim("b2", "A", 2, now=now, until=now + 60)
    first.retry_later(one, time.time() + 0.3)
    first.release("A")  # a graceful stop: the line A still held goes back now, not after its lease
    assert [line.idx for line in second.claim("b2", "B", 2, now=time.time(), until=time.time() + 60)] == [1]
    retried = wait_until(
        lambda: second.claim("b2", "B", 2, now=time.time(), until=time.time() + 60), message="the backoff ran out"
    )
    assert [(line.idx, line.attempts) for line in retried] == [(0, 1)]
    second.renew("B", [("b2", 0)], time.time() + 60)
    assert not first.claim("b2", "A", 2, now=time.time(), until=time.time() + 60)


def test_routers_claiming_at_once_never_take_the_same_line(stores: tuple[Store, Store]) -> None:
    first, second = stores
    first.create_batch(
        _batch_record("b3", 300), ((f"c{i}", "/v1/chat/completions", "{}") for i in range(300)), limit=10**9
    )
    taken: dict[str, list[int]] = {"A": [], "B": []}
    together = threading.Barrier(2, timeout=30)  # each round, both claim at the same moment

    def take(store: Store, owner: str) -> None:
        while True:
            with contextlib.suppress(threading.BrokenBarrierError):  # the other is done: go on alone
                together.wait()
            lines = store.claim("b3", owner, 3, now=time.time(), until=time.time() + 600)
            if not lines:
                together.abort()
                return
            taken[owner] += [line.idx for line in lines]

    threads = [threading.Thread(target=take, args=pair) for pair in ((first, "A"), (second, "B"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(taken["A"] + taken["B"]) == list(range(300))  # every line once, by one of them
    assert taken["A"] and taken["B"]


@pytest.mark.e2e
def test_a_database_that_refuses_the_tables_leaves_the_router_serving(
    postgres: PostgresServer,
    monkeypatch: pytest.MonkeyPatch,
    make_cluster: Callable[..., AbstractContextManager[Cluster]],
) -> None:
    """A role without the right to create tables (PostgreSQL 15 gives none on `public`): the
    router starts and serves live traffic, the Batch API answers 503 saying why."""
    database = "t_" + uuid.uuid4().hex[:12]
    postgres.database(database)
    role = "reader_" + uuid.uuid4().hex[:8]
    with psycopg.connect(postgres.dsn(), autocommit=True) as db:
        db.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'reader-secret'")
    monkeypatch.setenv(DSN_ENV, f"postgresql://{role}:reader-secret@127.0.0.1:{postgres.port}/{database}")
    with make_cluster(batch=_store()) as cluster:
        answer = httpx.get(cluster.base_url + "/batches")
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "batch_store_unavailable"
        client = cluster.client("none")
        assert client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi"}])
        status = httpx.get(cluster.router.url + "/router/status").json()["batches"]
        assert "tables could not be made" in status["store_error"] and "permission denied" in status["store_error"]
