"""The Batch API through the official `openai` SDK, against a router in front of fake engines."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from router.batch.runner import RATE_WINDOW
from router.batch.service import REOPEN_SECONDS
from tests.batches import batch_input
from tests.conftest import Cluster
from tests.timing import too_busy_to_time
from tests.wait import until

pytestmark = pytest.mark.e2e  # the router served on loopback in front of fake engines

KEYS_ENV = "SPECROUTE_TEST_BATCH_KEYS"
FAST = {"poll_interval": 0.05, "retry_backoff": 0.05}
ENDED = ("completed", "cancelled", "expired", "failed")


def _wait(condition: Callable[[], Any], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)
    return value


def _finished(client: openai.OpenAI, batch_id: str, timeout: float = 20.0) -> Any:
    return _wait(
        lambda: (b := client.batches.retrieve(batch_id)).status in ENDED and b,
        timeout,
    )


def _jsonl(content: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in content.decode().splitlines() if line.strip()]


@pytest.fixture
def keyed(
    monkeypatch: pytest.MonkeyPatch, make_cluster: Callable[..., AbstractContextManager[Cluster]]
) -> Iterator[Cluster]:
    monkeypatch.setenv(KEYS_ENV, "alice-key,bob-key")
    with make_cluster(auth={"client_keys_env": KEYS_ENV}, batch=FAST) as cluster:
        yield cluster


def test_whole_cycle_with_the_sync_sdk(keyed: Cluster) -> None:
    client = keyed.client("alice-key")
    uploaded = client.files.create(file=("input.jsonl", batch_input(20)), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.filename == "input.jsonl" and uploaded.bytes == len(batch_input(20))
    assert client.files.retrieve(uploaded.id).id == uploaded.id
    assert client.files.content(uploaded.id).content == batch_input(20)

    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"job": "eval"}
    )
    assert batch.status == "validating" and batch.metadata == {"job": "eval"}
    assert batch.expires_at == batch.created_at + 24 * 3600
    done = _finished(client, batch.id)
    assert done.status == "completed"
    assert done.request_counts is not None and (done.request_counts.total, done.request_counts.completed) == (20, 20)
    assert done.in_progress_at and done.finalizing_at and done.completed_at and done.error_file_id is None
    assert done.output_file_id is not None
    output = _jsonl(client.files.content(done.output_file_id).content)
    assert sorted(row["custom_id"] for row in output) == sorted(f"r-{i}" for i in range(20))
    for row in output:
        assert row["error"] is None and row["response"]["status_code"] == 200
        assert row["id"] == row["response"]["request_id"]
        assert row["response"]["body"]["choices"][0]["message"]["content"] == "w0 w1 w2 w3"
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"
    # Run as batch work on the standard pool, through the request path: counted and decided there.
    assert len(keyed.team.requests) == 20 and not keyed.fast.requests
    assert all("x-job-type" not in seen.headers for seen in keyed.team.requests)
    assert keyed.settled_metric("specroute_batch_lines_total", 20, result="completed") == 20
    assert (
        keyed.metric(
            "specroute_route_decisions_total", job_class="batch", pool="team", reason="header", content="prose"
        )
        == 20
    )
    assert keyed.metric("specroute_batches", status="completed") == 1
    status = httpx.get(keyed.router.url + "/router/status").json()["batches"]
    assert status["by_status"]["completed"] == 1 and status["in_flight"] == 0

    # Listing: newest first, in pages.
    more = [
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h").id
        for _ in range(2)
    ]
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == [more[1], more[0]] and page.has_more
    rest = client.batches.list(limit=2, after=page.data[-1].id)
    assert [b.id for b in rest.data] == [batch.id] and not rest.has_more
    assert {f.id for f in client.files.list()} >= {uploaded.id, done.output_file_id}
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)
    for batch_id in more:
        _finished(client, batch_id)  # deleting the input file does not stop its batches


def test_a_line_the_engine_rejects_goes_to_the_error_file_async(keyed: Cluster) -> None:
    async def main() -> None:
        client = openai.AsyncOpenAI(base_url=keyed.base_url, api_key="alice-key", max_retries=0)
        content = batch_input(3) + batch_input(1, prefix="bad", model="no-such-model")
        uploaded = await client.files.create(file=("mixed.jsonl", content), purpose="batch")
        batch = await client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        batch = await _finished_async(client, batch.id)
        assert batch.status == "completed"
        assert batch.request_counts is not None
        assert (batch.request_counts.completed, batch.request_counts.failed) == (3, 1)
        assert batch.output_file_id and batch.error_file_id
        errors = _jsonl((await client.files.content(batch.error_file_id)).content)
        assert [row["custom_id"] for row in errors] == ["bad-0"]
        assert errors[0]["response"]["status_code"] == 404
        assert "no-such-model" in errors[0]["response"]["body"]["error"]["message"]
        output = _jsonl((await client.files.content(batch.output_file_id)).content)
        assert sorted(row["custom_id"] for row in output) == ["r-0", "r-1", "r-2"]
        await client.close()

    asyncio.run(main())
    assert keyed.settled_metric("specroute_batch_lines_total", 1, result="failed") == 1


def test_a_line_whose_url_is_not_the_batchs_endpoint_makes_it_failed(keyed: Cluster) -> None:
    client = keyed.client("alice-key")
    elsewhere = batch_input(1, prefix="e", url="/v1/embeddings") + batch_input(1, prefix="c", url="/v1/completions")
    content = batch_input(2) + elsewhere
    uploaded = client.files.create(file=("mixed.jsonl", content), purpose="batch")  # each line is valid
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.status == "failed" and batch.failed_at == batch.created_at
    assert batch.errors is not None and batch.errors.data is not None
    assert [(e.code, e.line, e.param) for e in batch.errors.data] == [
        ("invalid_url", 3, "url"),
        ("invalid_url", 4, "url"),
    ]
    assert batch.errors.data[0].message is not None and "'/v1/embeddings'" in batch.errors.data[0].message
    # The runner has looked (its count of batches shows it), and leaves it as it is: nothing run.
    _wait(lambda: httpx.get(keyed.router.url + "/router/status").json()["batches"]["by_status"].get("failed") == 1)
    again = client.batches.retrieve(batch.id)
    assert again.status == "failed" and again.in_progress_at is None
    assert again.output_file_id is None and again.error_file_id is None
    assert again.request_counts is not None and again.request_counts.total == 0
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)
    assert not keyed.team.requests and not keyed.fast.requests


@pytest.mark.parametrize(("status", "sent"), [(302, 1), (429, 2)])
def test_a_line_answered_other_than_2xx_goes_to_the_error_file(
    make_cluster: Callable[..., AbstractContextManager[Cluster]], status: int, sent: int
) -> None:
    # A 3xx is no success: never in the output file. A 429 is tried again, `max_attempts` in all.
    with make_cluster(batch={**FAST, "max_attempts": 2}) as cluster:
        cluster.team.fail_status = status
        client = cluster.client("none")
        uploaded = client.files.create(file=("one.jsonl", batch_input(1)), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        done = _finished(client, batch.id)
        assert done.status == "completed" and done.output_file_id is None and done.error_file_id
        assert done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (0, 1)
        errors = _jsonl(client.files.content(done.error_file_id).content)
        assert [(row["custom_id"], row["response"]["status_code"]) for row in errors] == [("r-0", status)]
        assert len(cluster.team.requests) == sent


# A malformed input file, the line its 400 names, and why: for the sync and async SDK alike.
MALFORMED = [
    (batch_input(2) + b"{not json\n", 3, "not valid JSON"),
    (batch_input(2) + batch_input(1), 3, "custom_id 'r-0' is used more than once"),
    (b'{"custom_id": "a", "method": "GET", "url": "/v1/chat/completions", "body": {}}\n', 1, "method must be POST"),
    (b'{"custom_id": "a", "method": "POST", "url": "/v1/models", "body": {}}\n', 1, "url must be one of"),
    (b'{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": []}\n', 1, "body must be"),
    (b'\n{"method": "POST", "url": "/v1/embeddings", "body": {}}\n', 2, "custom_id must be"),
    (batch_input(1, stream=True), 1, "streamed"),
    (b"[1]\n", 1, "must be a JSON object"),
    (batch_input(1) + batch_input(1, prefix="a\x00"), 2, "custom_id must not hold U+0000"),  # nor can PostgreSQL
    (batch_input(1, model="m\x00"), 1, "body.model must not hold U+0000"),
    (batch_input(1) + b"[" * 100_000 + b"]" * 100_000 + b"\n", 2, "nested more than"),  # never a 500
]


@pytest.mark.parametrize(("content", "line", "why"), MALFORMED)
def test_a_malformed_file_is_400_naming_the_line(keyed: Cluster, content: bytes, line: int, why: str) -> None:
    client = keyed.client("alice-key")
    with pytest.raises(openai.BadRequestError) as caught:
        client.files.create(file=("bad.jsonl", content), purpose="batch")
    _assert_invalid_file(caught.value, line, why)
    assert not list(client.files.list())  # nothing kept


@pytest.mark.parametrize(("content", "line", "why"), MALFORMED)
def test_a_malformed_file_is_400_naming_the_line_async(keyed: Cluster, content: bytes, line: int, why: str) -> None:
    async def main() -> None:
        async with openai.AsyncOpenAI(base_url=keyed.base_url, api_key="alice-key", max_retries=0) as client:
            with pytest.raises(openai.BadRequestError) as caught:
                await client.files.create(file=("bad.jsonl", content), purpose="batch")
            _assert_invalid_file(caught.value, line, why)
            assert not [f async for f in client.files.list()]  # nothing kept

    asyncio.run(main())


def _assert_invalid_file(caught: openai.BadRequestError, line: int, why: str) -> None:
    error = caught.body
    assert isinstance(error, dict)
    assert error["message"].startswith(f"line {line}: ") and why in error["message"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "file", "invalid_file")


def test_a_list_cursor_naming_another_keys_file_says_nothing_of_it(keyed: Cluster) -> None:
    # Bob's page after Alice's file id is the page after an id that does not exist: a cursor
    # that moved would tell Bob that the id exists, and when it was made.
    alice = keyed.client("alice-key")
    bob = keyed.client("bob-key")
    first = bob.files.create(file=("b1.jsonl", batch_input(1)), purpose="batch")
    hers = alice.files.create(file=("a.jsonl", batch_input(1)), purpose="batch")
    second = bob.files.create(file=("b2.jsonl", batch_input(1)), purpose="batch")

    def page(after: str) -> list[str]:
        answer = httpx.get(
            keyed.base_url + "/files", params={"after": after}, headers={"authorization": "Bearer bob-key"}
        )
        assert answer.status_code == 200
        return [each["id"] for each in answer.json()["data"]]

    assert page(second.id) == [first.id]  # newest first: the cursor works on Bob's own
    assert page(hers.id) == page("file-nobody-made")


def test_another_keys_files_and_batches_are_404(keyed: Cluster) -> None:
    alice = keyed.client("alice-key")
    bob = keyed.client("bob-key")
    uploaded = alice.files.create(file=("a.jsonl", batch_input(2)), purpose="batch")
    batch = alice.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    for attempt in _foreign_attempts(bob, batch.id, uploaded.id):
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert not bob.batches.list().data and not list(bob.files.list())
    assert _finished(alice, batch.id).status == "completed"
    # No key, or an unknown one: 401 before anything is read.
    for key in (None, "mallory-key"):
        headers = {"authorization": f"Bearer {key}"} if key else {}
        answer = httpx.get(keyed.base_url + "/batches", headers=headers)
        assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"


def test_another_keys_files_and_batches_are_404_async(keyed: Cluster) -> None:
    async def main() -> None:
        alice = openai.AsyncOpenAI(base_url=keyed.base_url, api_key="alice-key", max_retries=0)
        bob = openai.AsyncOpenAI(base_url=keyed.base_url, api_key="bob-key", max_retries=0)
        async with alice, bob:
            uploaded = await alice.files.create(file=("a.jsonl", batch_input(2)), purpose="batch")
            batch = await alice.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            for attempt in _foreign_attempts(bob, batch.id, uploaded.id):
                with pytest.raises(openai.NotFoundError):
                    await attempt()
            assert not (await bob.batches.list()).data and not [f async for f in bob.files.list()]
            assert (await _finished_async(alice, batch.id)).status == "completed"

    asyncio.run(main())


def _foreign_attempts(client: Any, batch_id: str, file_id: str) -> list[Callable[[], Any]]:
    """Everything another key may try on a batch and file not its own (each a 404), for
    `openai.OpenAI` or `openai.AsyncOpenAI` (then each returns what to await)."""
    return [
        lambda: client.batches.retrieve(batch_id),
        lambda: client.batches.cancel(batch_id),
        lambda: client.files.retrieve(file_id),
        lambda: client.files.content(file_id),
        lambda: client.files.delete(file_id),
        lambda: client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"),
    ]


async def _finished_async(client: openai.AsyncOpenAI, batch_id: str) -> Any:
    async def ended() -> Any:
        batch = await client.batches.retrieve(batch_id)
        return batch.status in ENDED and batch

    return await until(ended, timeout=20, message=f"batch {batch_id} ended")


async def _completed_at_least_async(client: openai.AsyncOpenAI, batch_id: str, lines: int) -> None:
    async def done() -> bool:
        counts = (await client.batches.retrieve(batch_id)).request_counts
        return counts is not None and counts.completed >= lines

    await until(done, timeout=20, message=f"{lines} lines of {batch_id} done")


async def _files_async(client: openai.AsyncOpenAI, *file_ids: str | None) -> list[list[dict[str, Any]]]:
    return [_jsonl((await client.files.content(file_id)).content) if file_id else [] for file_id in file_ids]


def test_cancel_keeps_the_lines_done(make_cluster: Callable[..., AbstractContextManager[Cluster]]) -> None:
    with make_cluster(batch={**FAST, "max_concurrency": 2}) as cluster:
        cluster.team.token_delay = 0.05  # 4 tokens: 0.2 s a line
        client = cluster.client("none")
        uploaded = client.files.create(file=("slow.jsonl", batch_input(40)), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        _wait(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 2)  # type: ignore[union-attr]
        cancelling = client.batches.cancel(batch.id)
        assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
        done = _finished(client, batch.id)
        output = _jsonl(client.files.content(done.output_file_id).content)
        errors = _jsonl(client.files.content(done.error_file_id).content)
        _assert_cancelled(cluster, done, output, errors, 40)
        with pytest.raises(openai.ConflictError):
            client.batches.cancel(
                _finished(
                    client,
                    client.batches.create(
                        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
                    ).id,
                    timeout=30,
                ).id
            )


def test_cancel_keeps_the_lines_done_async(make_cluster: Callable[..., AbstractContextManager[Cluster]]) -> None:
    with make_cluster(batch={**FAST, "max_concurrency": 2}) as cluster:
        cluster.team.token_delay = 0.05  # 4 tokens: 0.2 s a line

        async def main() -> None:
            async with openai.AsyncOpenAI(base_url=cluster.base_url, api_key="none", max_retries=0) as client:
                uploaded = await client.files.create(file=("slow.jsonl", batch_input(40)), purpose="batch")
                batch = await client.batches.create(
                    input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
                )
                await _completed_at_least_async(client, batch.id, 2)
                cancelling = await client.batches.cancel(batch.id)
                assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
                done = await _finished_async(client, batch.id)
                output, errors = await _files_async(client, done.output_file_id, done.error_file_id)
                _assert_cancelled(cluster, done, output, errors, 40)
                again = await client.batches.cancel(batch.id)  # cancelled already: answered as it is
                assert again.status == "cancelled" and again.request_counts == done.request_counts

        asyncio.run(main())


def _assert_cancelled(
    cluster: Cluster, done: Any, output: list[dict[str, Any]], errors: list[dict[str, Any]], lines: int
) -> None:
    """A batch of `lines` cancelled after two or more were done: those in the output, the rest
    in the error file as not run, and nothing sent to the engine after the cancel finished."""
    assert done.status == "cancelled" and done.cancelled_at is not None
    counts = done.request_counts
    assert counts is not None and 2 <= counts.completed < lines and counts.failed == 0
    assert len(output) == counts.completed and len(output) + len(errors) == lines
    assert {row["error"]["code"] for row in errors} == {"batch_cancelled"}
    assert len(cluster.team.requests) == counts.completed


class FakeClock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def test_a_batch_expires_after_its_window_with_the_lines_done(
    make_cluster: Callable[..., AbstractContextManager[Cluster]],
) -> None:
    clock = FakeClock()
    with make_cluster(clock=clock, batch={**FAST, "max_concurrency": 2}) as cluster:
        cluster.team.token_delay = 0.05
        client = cluster.client("none")
        uploaded = client.files.create(file=("slow.jsonl", batch_input(40)), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        _wait(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 2)  # type: ignore[union-attr]
        assert client.batches.retrieve(batch.id).status == "in_progress"
        clock.now += 24 * 3600
        done = _finished(client, batch.id)
        output = _jsonl(client.files.content(done.output_file_id).content)
        errors = _jsonl(client.files.content(done.error_file_id).content)
        _assert_expired(clock, done, output, errors, 40)


def test_a_batch_expires_after_its_window_with_the_lines_done_async(
    make_cluster: Callable[..., AbstractContextManager[Cluster]],
) -> None:
    clock = FakeClock()
    with make_cluster(clock=clock, batch={**FAST, "max_concurrency": 2}) as cluster:
        cluster.team.token_delay = 0.05

        async def main() -> None:
            async with openai.AsyncOpenAI(base_url=cluster.base_url, api_key="none", max_retries=0) as client:
                uploaded = await client.files.create(file=("slow.jsonl", batch_input(40)), purpose="batch")
                batch = await client.batches.create(
                    input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
                )
                await _completed_at_least_async(client, batch.id, 2)
                assert (await client.batches.retrieve(batch.id)).status == "in_progress"
                clock.now += 24 * 3600
                done = await _finished_async(client, batch.id)
                output, errors = await _files_async(client, done.output_file_id, done.error_file_id)
                _assert_expired(clock, done, output, errors, 40)

        asyncio.run(main())


def _assert_expired(
    clock: FakeClock, done: Any, output: list[dict[str, Any]], errors: list[dict[str, Any]], lines: int
) -> None:
    """A batch of `lines` expired (at `clock`'s time) with two or more done: those in the output,
    the rest failed as `batch_expired`, every line once."""
    assert done.status == "expired" and done.expired_at == int(clock.now)
    counts = done.request_counts
    assert counts is not None and counts.completed >= 2 and counts.completed + counts.failed == lines
    assert len(output) == counts.completed and len(errors) == counts.failed
    assert {row["error"]["code"] for row in errors} == {"batch_expired"}
    assert {row["custom_id"] for row in output + errors} == {f"r-{i}" for i in range(lines)}


def test_the_status_page_counts_lines_and_lines_per_second(
    make_cluster: Callable[..., AbstractContextManager[Cluster]],
) -> None:
    clock = FakeClock()  # lines per second is read off the batches' clock: this one moves when told
    with make_cluster(clock=clock, batch=FAST) as cluster:
        client = cluster.client("none")
        content = batch_input(11) + batch_input(1, prefix="bad", model="no-such-model")
        uploaded = client.files.create(file=("a.jsonl", content), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert _finished(client, batch.id).status == "completed"

        def status() -> dict[str, Any]:
            return dict(httpx.get(cluster.router.url + "/router/status").json()["batches"])

        assert status()["lines"] == {"completed": 11, "failed": 1}
        assert status()["lines_per_second"] == round(12 / RATE_WINDOW, 3)  # all 12 in the window
        assert cluster.metric("specroute_batch_lines_per_second") == pytest.approx(12 / RATE_WINDOW)
        clock.now += RATE_WINDOW / 2
        assert status()["lines_per_second"] == round(12 / RATE_WINDOW, 3)
        clock.now += RATE_WINDOW / 2 + 1  # the lines are over a window old
        assert status()["lines_per_second"] == 0 and cluster.metric("specroute_batch_lines_per_second") == 0
        assert status()["lines"] == {"completed": 11, "failed": 1}  # totals stay


def test_batches_take_turns(make_cluster: Callable[..., AbstractContextManager[Cluster]]) -> None:
    with make_cluster(batch={**FAST, "max_concurrency": 1}) as cluster:
        cluster.team.token_delay = 0.02
        client = cluster.client("none")
        first = client.files.create(file=("a.jsonl", batch_input(12, prefix="a")), purpose="batch")
        second = client.files.create(file=("b.jsonl", batch_input(6, prefix="b")), purpose="batch")
        batches = [
            client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
            for f in (first, second)
        ]
        for batch in batches:
            assert _finished(client, batch.id).status == "completed"
        ids = [_custom_id(s.body) for s in cluster.team.requests]
        start = next(i for i, c in enumerate(ids) if c.startswith("b"))
        # Once the second batch has joined, the two alternate until it is done.
        window = ids[start : start + 12]
        assert [c[0] for c in window] in (list("baba" * 3), list("abab" * 3)), ids


def _custom_id(body: dict[str, Any]) -> str:
    """The line a request came from: `batch_input` writes its custom_id as the message."""
    return str(body["messages"][0]["content"])


def test_hostile_uploads_are_answered_and_nothing_is_kept(keyed: Cluster) -> None:
    headers = {"authorization": "Bearer alice-key"}
    url = keyed.base_url + "/files"
    # Not multipart at all, and multipart without a file.
    for answer in (
        httpx.post(url, headers=headers, content=b"garbage"),
        httpx.post(url, headers=headers, data={"purpose": "batch"}, files={"other": ("x", b"{}")}),
        httpx.post(
            url, headers={**headers, "content-type": "multipart/form-data; boundary=zz"}, content=b"--zz\r\nbroken"
        ),
    ):
        assert answer.status_code == 400, answer.text
        assert set(answer.json()["error"]) == {"message", "type", "param", "code"}
    wrong_purpose = httpx.post(
        url, headers=headers, data={"purpose": "fine-tune"}, files={"file": ("a", batch_input(1))}
    )
    assert wrong_purpose.status_code == 400 and wrong_purpose.json()["error"]["param"] == "purpose"
    bad_json = httpx.post(keyed.base_url + "/batches", headers=headers, content=b"{nope")
    assert bad_json.status_code == 400 and bad_json.json()["error"]["code"] == "invalid_json"
    for params in (
        {"input_file_id": "file-x", "endpoint": "/v1/chat/completions", "completion_window": "1h"},
        {"input_file_id": "file-x", "endpoint": "/v1/models", "completion_window": "24h"},
    ):
        answer = httpx.post(keyed.base_url + "/batches", headers=headers, json=params)
        assert answer.status_code == 400
    missing = httpx.post(
        keyed.base_url + "/batches",
        headers=headers,
        json={"input_file_id": "file-x", "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    )
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "file_not_found"
    # A body declared too large is refused before it is read: raw socket, head only.
    port = keyed.router.port
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        raw.sendall(
            b"POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer alice-key\r\n"
            b"Content-Type: multipart/form-data; boundary=zz\r\nContent-Length: 999999999999\r\n\r\n"
        )
        head = raw.recv(65536).decode()
    assert head.startswith("HTTP/1.1 413") and "file_too_large" in head
    # Other paths under /v1/files and /v1/batches are the router's, never forwarded.
    for method, path in (("POST", "/files/file-x"), ("POST", "/batches/b/x"), ("PUT", "/batches")):
        answer = httpx.request(method, keyed.base_url + path, headers=headers)
        assert answer.status_code in (404, 405) and "error" in answer.json()
    assert not keyed.team.requests and not keyed.fast.requests
    client = keyed.client("alice-key")
    assert not list(client.files.list())
    assert keyed.metric("specroute_in_flight_requests", pool="team", backend="team-1") == 0
    assert client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi"}]).choices


def test_file_and_storage_limits(monkeypatch: pytest.MonkeyPatch, make_cluster: Callable[..., Any]) -> None:
    one = len(batch_input(1))
    with make_cluster(batch={**FAST, "max_file_bytes": 3 * one, "max_storage_bytes": 5 * one}) as cluster:
        client = cluster.client("none")
        with pytest.raises(openai.APIStatusError) as caught:
            client.files.create(file=("big.jsonl", batch_input(4)), purpose="batch")
        assert caught.value.status_code == 413 and caught.value.code == "file_too_large"
        client.files.create(file=("a.jsonl", batch_input(3)), purpose="batch")
        with pytest.raises(openai.APIStatusError) as caught:
            client.files.create(file=("b.jsonl", batch_input(3)), purpose="batch")
        assert caught.value.status_code == 413 and caught.value.code == "storage_full"
        assert len(list(client.files.list())) == 1


def test_storage_counts_a_batchs_lines_and_its_output_files(
    make_cluster: Callable[..., AbstractContextManager[Cluster]],
) -> None:
    ten, seven = batch_input(10), batch_input(7)
    # The two files fit exactly, with nothing else kept; the copy of ten lines fits where the
    # second file would go (its lines are shorter: no custom_id's and method's names, no spaces).
    limit = len(ten) + len(seven)
    with make_cluster(batch={**FAST, "max_storage_bytes": limit}) as cluster:
        gate = threading.Event()
        cluster.team.gate = gate  # the lines wait in the engine: the batch stays unfinished
        client = cluster.client("none")

        def full(content: bytes) -> None:
            with pytest.raises(openai.APIStatusError) as caught:
                client.files.create(file=("b.jsonl", content), purpose="batch")
            assert caught.value.status_code == 413 and caught.value.code == "storage_full"

        uploaded = client.files.create(file=("a.jsonl", ten), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        _wait(lambda: cluster.team.open >= 1)
        full(seven)  # the batch's copy of its ten lines takes room
        gate.set()
        done = _finished(client, batch.id)
        assert done.status == "completed" and done.output_file_id is not None
        output = client.files.retrieve(done.output_file_id)
        assert output.bytes > len(seven)  # ten answers, each longer than its request
        full(batch_input(1))  # the output file counts; the lines' copies are gone with the batch done
        client.files.delete(done.output_file_id)
        assert client.files.create(file=("b.jsonl", seven), purpose="batch").bytes == len(seven)
        full(batch_input(1))


def test_a_batch_the_store_has_no_room_for_is_413_and_leaves_nothing(
    make_cluster: Callable[..., AbstractContextManager[Cluster]],
) -> None:
    # Each batch keeps a copy of its lines: batches made again and again from one file must not
    # grow the store past its limit while their lines wait.
    content = batch_input(10)
    rows = [json.loads(row) for row in content.splitlines()]
    copy = sum(len(r["custom_id"]) + len(r["url"]) + len(json.dumps(r["body"], separators=(",", ":"))) for r in rows)
    with make_cluster(batch={**FAST, "max_storage_bytes": len(content) + 2 * copy + copy // 2}) as cluster:
        gate = threading.Event()
        cluster.team.gate = gate  # the lines wait in the engine: every batch stays unfinished
        client = cluster.client("none")
        uploaded = client.files.create(file=("a.jsonl", content), purpose="batch")

        def create() -> Any:
            return client.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
            )

        made = [create(), create()]
        for _ in range(3):
            with pytest.raises(openai.APIStatusError) as caught:
                create()
            assert caught.value.status_code == 413 and caught.value.code == "storage_full"
            assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "input_file_id"
        assert [b.id for b in client.batches.list().data] == [made[1].id, made[0].id]
        gate.set()
        for batch in made:
            done = _finished(client, batch.id)
            assert done.status == "completed" and done.request_counts is not None
            assert done.request_counts.completed == 10
        assert len(cluster.team.requests) == 20


def test_a_batchs_model_is_a_name_not_a_megabyte(keyed: Cluster) -> None:
    # The batch keeps the first model its file names, and every list of batches shows it: a
    # model of 1 MB (a line may hold 4 MiB) would make a page of 100 batches 100 MB to build.
    client = keyed.client("alice-key")
    content = batch_input(1, prefix="long", model="m" * 1_000_000) + batch_input(1)
    uploaded = client.files.create(file=("long.jsonl", content), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.model == "test-model"  # the first name of at most 256 characters
    page = httpx.get(keyed.base_url + "/batches", headers={"authorization": "Bearer alice-key"})
    assert page.status_code == 200 and len(page.content) < 10_000
    assert _finished(client, batch.id).status == "completed"


def test_batch_lines_leave_room_for_live_requests(make_cluster: Callable[..., AbstractContextManager[Cluster]]) -> None:
    with make_cluster(batch={**FAST, "reserve_slots": 2}) as cluster:
        cluster.team.token_delay = 0.02
        pools = cluster.app.state.router.pools
        client = cluster.client("none")
        uploaded = client.files.create(file=("a.jsonl", batch_input(60)), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        busiest = queued = 0
        live = []
        deadline = time.monotonic() + 30
        while client.batches.retrieve(batch.id).status != "completed":
            assert time.monotonic() < deadline
            busiest = max(busiest, cluster.team.open)
            queued = max(queued, pools["team"].queued())
            # A live request sent to the standard pool meanwhile finds a free slot at once.
            started = time.perf_counter()
            answer = httpx.post(
                cluster.base_url + "/chat/completions",
                headers={"x-job-type": "batch"},
                json={"model": "test-model", "max_tokens": 1, "messages": [{"role": "user", "content": "live"}]},
            )
            live.append((answer.status_code, answer.headers["x-route-pool"], time.perf_counter() - started))
        assert 2 <= busiest <= 8 - 2 + 1, busiest  # six lines at most, and the one live request
        assert queued == 0
        assert live and all(status == 200 and pool == "team" for status, pool, _ in live)
        # Every line and every live request took a free slot at once: none joined the queue (a count,
        # not a wait read off the clock, which a stalled test process stretches).
        assert cluster.metric("specroute_queue_entries_total", pool="team", job_class="batch") == 0


def test_batch_lines_are_trusted_without_opening_overrides_to_clients(
    monkeypatch: pytest.MonkeyPatch, make_cluster: Callable[..., AbstractContextManager[Cluster]]
) -> None:
    monkeypatch.setenv(KEYS_ENV, "alice-key")
    monkeypatch.setenv("SPECROUTE_TEST_OVERRIDE_KEYS", "ops-key")
    auth = {"client_keys_env": KEYS_ENV, "override_keys_env": "SPECROUTE_TEST_OVERRIDE_KEYS"}
    with make_cluster(auth={**auth, "untrusted_overrides": "reject"}, batch=FAST) as cluster:
        client = cluster.client("alice-key")
        with pytest.raises(openai.PermissionDeniedError):
            client.chat.completions.create(
                model="test-model", messages=[{"role": "user", "content": "x"}], extra_headers={"X-Job-Type": "batch"}
            )
        uploaded = client.files.create(file=("a.jsonl", batch_input(3)), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert _finished(client, batch.id).status == "completed"
        assert len(cluster.team.requests) == 3
        assert (
            cluster.metric(
                "specroute_route_decisions_total", job_class="batch", pool="team", reason="header", content="prose"
            )
            == 3
        )


@pytest.mark.parametrize(("lines", "token_delay", "lease"), [(80, 0.02, 60.0), (20, 0.5, 1.5)])
def test_two_routers_on_one_store_run_each_line_once(
    tmp_path: Path,
    make_cluster: Callable[..., AbstractContextManager[Cluster]],
    lines: int,
    token_delay: float,
    lease: float,
) -> None:
    """Second case: each line takes 2 s, its lease 1.5 s; the lease is renewed while it runs
    (every 0.5 s). A machine that stalls a renewal past the lease has the other router take the
    line, as it should: that case is timed, and skips when the machine is too busy to time."""
    if lease < 60 and (busy := too_busy_to_time()):
        pytest.skip(busy)
    shared = {**FAST, "store_dir": str(tmp_path), "lease_seconds": lease}
    with make_cluster(batch=shared) as first, make_cluster(batch=shared) as second:
        for cluster in (first, second):
            cluster.team.token_delay = token_delay
        client = first.client("none")
        uploaded = client.files.create(file=("a.jsonl", batch_input(lines)), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        done = _finished(second.client("none"), batch.id, timeout=40)
        assert done.status == "completed" and done.request_counts is not None and done.request_counts.completed == lines
        sent = [_custom_id(seen.body) for cluster in (first, second) for seen in cluster.team.requests]
        assert sorted(sent) == sorted(f"r-{i}" for i in range(lines))  # each line sent once, by one router
        assert first.team.requests and second.team.requests  # and both took part


def test_bench_batchjob_runs_a_batch_beside_interactive_users(
    tmp_path: Path, make_cluster: Callable[..., AbstractContextManager[Cluster]]
) -> None:
    from router.cli import main

    with make_cluster(batch=FAST) as cluster:
        code = main(
            ["bench", "batchjob", "--base-url", cluster.base_url, "--model", "test-model", "--interactive", "2",
             "--lines", "30", "--duration", "1", "--think", "0.1", "--max-tokens", "4", "--batch-max-tokens", "4",
             "--out", str(tmp_path)]
        )  # fmt: skip
    assert code == 0
    result = json.loads((tmp_path / "batchjob.json").read_text())
    assert result["batch"]["status"] == "completed" and result["batch"]["completed"] == 30
    assert result["alone"]["requests"] > 0 and result["beside"]["requests"] > 0
    assert result["alone"]["errors"] == result["beside"]["errors"] == 0
    assert (
        "10,000" not in (tmp_path / "report.md").read_text() and "30-line batch" in (tmp_path / "report.md").read_text()
    )


def test_the_batch_backs_off_when_live_requests_queue_on_its_pool(
    make_cluster: Callable[..., AbstractContextManager[Cluster]],
) -> None:
    with make_cluster(batch={**FAST, "max_concurrency": 8}) as cluster:
        cluster.team.token_delay = 0.05  # a batch line: 4 tokens, 0.2 s
        client = cluster.client("none")
        uploaded = client.files.create(file=("a.jsonl", batch_input(400)), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        _wait(lambda: cluster.metric("specroute_batch_concurrency_limit") >= 4)  # it grew while nothing pushed back

        async def live(number: int) -> int:
            # Pinned to the batch's pool: 12 at once, with 8 slots there, some must queue.
            async with httpx.AsyncClient(timeout=60) as http:
                answer = await http.post(
                    cluster.base_url + "/chat/completions",
                    headers={"x-route-pool": "team"},
                    json={"model": "test-model", "max_tokens": 30, "messages": [{"role": "user", "content": "live"}]},
                )
                return answer.status_code

        lowest = 8.0

        async def burst() -> list[int]:
            nonlocal lowest
            tasks = [asyncio.create_task(live(i)) for i in range(12)]
            while not all(task.done() for task in tasks):
                lowest = min(lowest, cluster.metric("specroute_batch_concurrency_limit"))
                await asyncio.sleep(0.01)
            return [task.result() for task in tasks]

        assert asyncio.run(burst()) == [200] * 12
        assert lowest <= 2, lowest  # halved at least twice while live requests waited
        cluster.team.token_delay = 0.0  # what is left to see: every line done, once
        done = _finished(client, batch.id, timeout=60)
        assert done.status == "completed" and done.request_counts is not None and done.request_counts.completed == 400


def _grown_batch(cluster: Cluster, lines: int) -> tuple[openai.OpenAI, str]:
    """A batch of `lines` running, once its concurrency limit has grown to 4 (nothing pushed back)."""
    client = cluster.client("none")
    uploaded = client.files.create(file=("a.jsonl", batch_input(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    _wait(lambda: cluster.metric("specroute_batch_concurrency_limit") >= 4)
    return client, batch.id


def test_the_batch_backs_off_when_live_first_tokens_slow(
    make_cluster: Callable[..., AbstractContextManager[Cluster]],
) -> None:
    # Live streams one at a time, never more than the slots left: the pool never queues, and the
    # engine reports no load (no /metrics), so the first-token rise is the only signal.
    with make_cluster(batch={**FAST, "max_concurrency": 4, "ttft_rise": 2.0}) as cluster:
        cluster.team.token_delay = 0.05  # a batch line: 4 tokens, 0.2 s
        cluster.team.first_token_delay = 0.02
        client, batch_id = _grown_batch(cluster, 400)
        pools = cluster.app.state.router.pools

        def live() -> None:
            with httpx.stream(
                "POST",
                cluster.base_url + "/chat/completions",
                headers={"x-route-pool": "team"},
                json={
                    "model": "test-model",
                    "max_tokens": 1,
                    "stream": True,
                    "messages": [{"role": "user", "content": "live"}],
                },
                timeout=30,
            ) as answer:
                assert answer.status_code == 200
                answer.read()

        for _ in range(10):  # the floor: first tokens in 0.02 s
            live()
        assert cluster.metric("specroute_batch_concurrency_limit") >= 4
        cluster.team.first_token_delay = 0.3  # 15 times the floor
        # The limit halves as each slow first token comes, and grows back a line a tick: watched
        # all along, from another thread.
        lowest, queued, stop = [4.0], [0], threading.Event()

        def watch() -> None:
            while not stop.is_set():
                lowest[0] = min(lowest[0], cluster.metric("specroute_batch_concurrency_limit"))
                queued[0] = max(queued[0], pools["team"].queued())
                stop.wait(0.005)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            for _ in range(12):
                live()
        finally:
            stop.set()
            watcher.join()
        assert queued[0] == 0
        assert lowest[0] <= 2, lowest  # halved at least once as the live p50 rose
        cluster.team.first_token_delay = 0.0
        cluster.team.token_delay = 0.0  # what is left to see: every line done, once
        done = _finished(client, batch_id, timeout=90)
        assert done.status == "completed" and done.request_counts is not None and done.request_counts.completed == 400


def _engine_load(waiting: int) -> str:
    """An engine's /metrics as vLLM writes it: its running and waiting requests."""
    return (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="test-model"} 4.0\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{engine="0",model_name="test-model"}} {waiting}.0\n'
    )


def test_the_batch_backs_off_while_its_engines_report_waiting_requests(
    make_cluster: Callable[..., AbstractContextManager[Cluster]],
) -> None:
    # No live traffic at all: only the engine's own report of requests waiting pushes back.
    with make_cluster(batch={**FAST, "max_concurrency": 4}, scrape={"interval": 0.05}) as cluster:
        cluster.team.token_delay = 0.05
        cluster.team.metrics = _engine_load(0)
        client, batch_id = _grown_batch(cluster, 400)
        cluster.team.metrics = _engine_load(3)
        _wait(lambda: cluster.metric("specroute_batch_concurrency_limit") == 1, timeout=10)
        # And it stays down while they wait: checked over some ticks of the runner.
        seen = cluster.team.metrics_served
        _wait(lambda: cluster.team.metrics_served >= seen + 5)
        assert cluster.metric("specroute_batch_concurrency_limit") <= 2
        cluster.team.metrics = _engine_load(0)
        _wait(lambda: cluster.metric("specroute_batch_concurrency_limit") >= 3)  # growing again
        cluster.team.token_delay = 0.0  # what is left to see: every line done, once
        done = _finished(client, batch_id, timeout=90)
        assert done.status == "completed" and done.request_counts is not None and done.request_counts.completed == 400


@pytest.mark.parametrize("borrow", [True, False])
def test_the_speculative_pools_idle_room_only_when_allowed(
    make_cluster: Callable[..., AbstractContextManager[Cluster]], borrow: bool
) -> None:
    health = {"interval": 0.05, "unhealthy_after": 1, "healthy_after": 1}
    with make_cluster(batch=FAST, health=health, routing={"batch_may_use_speculative": borrow}) as cluster:
        cluster.team.healthy = False
        _wait(lambda: not httpx.get(cluster.router.url + "/readyz").json()["backends"]["team-1"])
        cluster.fast.token_delay = 0.02
        client = cluster.client("none")
        uploaded = client.files.create(file=("a.jsonl", batch_input(30)), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        if borrow:
            busiest = 0
            while client.batches.retrieve(batch.id).status != "completed":
                busiest = max(busiest, cluster.fast.open)
            assert len(cluster.fast.requests) == 30 and not cluster.team.requests
            assert busiest <= 4  # below the prose crossover: room interactive users would not miss
            return
        # Not allowed: the lines wait for the standard pool, none fails, none goes to the speculative one.
        # The runner has looked (and would have started lines right after) once the batch shows
        # as active on the status page.
        _wait(lambda: httpx.get(cluster.router.url + "/router/status").json()["batches"]["active"])
        assert client.batches.retrieve(batch.id).request_counts.completed == 0  # type: ignore[union-attr]
        assert not cluster.fast.requests and cluster.metric("specroute_batch_line_retries_total") == 0
        cluster.team.healthy = True
        assert _finished(client, batch.id).request_counts.completed == 30
        assert len(cluster.team.requests) == 30 and not cluster.fast.requests


def test_a_store_that_cannot_be_opened_leaves_live_traffic_served(
    tmp_path: Path, make_cluster: Callable[..., AbstractContextManager[Cluster]]
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with make_cluster(batch={"store_dir": str(blocker / "store")}) as cluster:
        client = cluster.client("none")
        assert client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi"}]).choices
        answer = httpx.get(cluster.base_url + "/batches")
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "batch_store_unavailable"
        status = httpx.get(cluster.router.url + "/router/status").json()["batches"]
        assert status["store"] is None and "a-file" in status["store_error"]
        # Retry-After is the interval the store is tried again at: a client that retries as told,
        # once the cause is gone, finds it open, and is not told to wait longer than that.
        retry_after = int(answer.headers["retry-after"])
        assert retry_after == REOPEN_SECONDS
        blocker.unlink()
        fixed = time.monotonic()
        _wait(lambda: httpx.get(cluster.base_url + "/batches").status_code == 200, timeout=retry_after + 10)
        assert time.monotonic() - fixed <= retry_after + 1


def test_disabled_the_batch_paths_are_forwarded_like_any_post(
    tmp_path: Path, make_cluster: Callable[..., AbstractContextManager[Cluster]]
) -> None:
    with make_cluster(batch={"enabled": False, "store_dir": str(tmp_path / "store")}) as cluster:
        answer = httpx.post(cluster.base_url + "/batches", json={"model": "test-model"})
        assert answer.status_code == 404 and answer.headers["x-route-pool"]  # the engine's own 404
        assert httpx.get(cluster.router.url + "/router/status").json()["batches"]["enabled"] is False
    assert not (tmp_path / "store").exists()
