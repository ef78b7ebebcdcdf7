"""A router killed with SIGKILL in the middle of a batch, started again on the same store: the
batch completes, every line answered exactly once, no recorded line sent to an engine again."""

from __future__ import annotations

import collections
import json
import signal
import sqlite3
import time
from pathlib import Path

import pytest

from tests.batches import batch_input, router_config
from tests.conftest import SDK
from tests.fake_engine import FakeEngine
from tests.servers import ServerThread, serve

pytestmark = pytest.mark.e2e  # `specroute serve` in its own process, killed and started again

LINES = 200
CONCURRENCY = 8  # the engine's slots in the router's settings: at most this many lines in flight


def _recorded(store: Path) -> set[str]:
    """The lines the killed router had recorded, read from its database as it left it."""
    with sqlite3.connect(store / "batches.sqlite3") as db:
        return {custom_id for (custom_id,) in db.execute("SELECT custom_id FROM lines WHERE done = 1")}


def test_a_batch_survives_sigkill_and_each_line_is_answered_once(tmp_path: Path, sdk: SDK) -> None:
    engine = FakeEngine(token_delay=0.02)  # in this process: it outlives the router
    with ServerThread(engine.app()) as server:
        store = tmp_path / "store"
        stored = {"store_dir": str(store), "poll_interval": 0.05, "lease_seconds": 1.0, "reserve_slots": 1}
        config = router_config(tmp_path, server.url, slots=CONCURRENCY, batch=stored)

        with serve(config) as (process, url):
            client = sdk(url)
            uploaded = client.files.create(file=("lines.jsonl", batch_input(LINES, prefix="line")), purpose="batch")
            batch = client.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            deadline = time.monotonic() + 30
            while (counts := client.batches.retrieve(batch.id).request_counts) is None or counts.completed < 40:
                assert time.monotonic() < deadline, "the batch did not start"
                time.sleep(0.01)
            process.send_signal(signal.SIGKILL)
            process.wait()
        sent_before = collections.Counter(seen.body["messages"][0]["content"] for seen in engine.requests)
        recorded = _recorded(store)
        assert 40 <= len(recorded) < LINES

        with serve(config) as (process, url):
            client = sdk(url)
            deadline = time.monotonic() + 60
            while (done := client.batches.retrieve(batch.id)).status != "completed":
                assert time.monotonic() < deadline, f"not resumed: {done}"
                time.sleep(0.05)
            assert done.output_file_id is not None
            output = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]

    answered = collections.Counter(row["custom_id"] for row in output)
    assert answered == collections.Counter(f"line-{i}" for i in range(LINES))  # each exactly once
    assert all(row["response"]["status_code"] == 200 for row in output)
    assert done.request_counts is not None and done.request_counts.completed == LINES
    sent = collections.Counter(seen.body["messages"][0]["content"] for seen in engine.requests)
    # A line recorded before the kill was never sent again; at most the lines in flight at the
    # kill (sent, not recorded) were sent twice.
    assert all(sent[line] == 1 for line in recorded)
    again = [line for line, times in sent.items() if times > 1]
    assert all(sent[line] == 2 and line not in recorded and sent_before[line] == 1 for line in again)
    assert len(again) <= CONCURRENCY - 1  # one slot is kept free for live requests (reserve_slots)
    assert set(sent) == set(answered)
