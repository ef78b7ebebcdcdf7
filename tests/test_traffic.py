"""The traffic record: entries as the observe stage makes them, bounded in memory and on disk,
written off the request path, read back by `specroute trace export`."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from router.clock import ManualClock
from router.config import Traffic
from router.record import Served, read_record
from router.traffic import TrafficRecorder
from tests.conftest import running_cluster
from tests.wait import wait_until


def _entry(number: int = 0, **changes: object) -> Served:
    fields: dict[str, object] = {
        "at": 1_700_000_000.0 + number, "job": "interactive", "kind": "prose", "prompt_tokens": 40,
        "answer_tokens": 512, "status": 200, "client": "key:0123456789ab", "conversation": None,
        "declared": False, "ttft": 0.25, "duration": 9.5,
    }  # fmt: skip
    return Served(**{**fields, **changes})  # type: ignore[arg-type]


def _recorder(path: Path | None, **config: object) -> TrafficRecorder:
    recorder = TrafficRecorder(clock=ManualClock())
    recorder.configure(Traffic(path=str(path) if path else None, **config))  # type: ignore[arg-type]
    return recorder


def test_an_entry_round_trips_through_its_line() -> None:
    entry = _entry(conversation="c0ffee", declared=True, ttft=None)
    assert Served.parse(entry.line()) == entry


@pytest.mark.parametrize(
    "line",
    [
        "",
        "not json",
        "{}",
        "[1]",
        '[2,1.0,"interactive","prose",1,1,200,null,null,0,null,0]',  # another format
        '[1,1.0,"admin","prose",1,1,200,null,null,0,null,0]',  # no such job class
        '[1,1.0,"batch","latin",1,1,200,null,null,0,null,0]',
        '[1,1.0,"batch","prose",-5,1,200,null,null,0,null,0]',
        '[1,"x","batch","prose",1,1,200,null,null,0,null,0]',
        '[1,1e300,"batch","prose",1,1,200,null,null,0,null,0]',
        '[1,1.0,"batch","prose",1,1,200,null,null,0,null,0',  # torn
    ],
)
def test_a_line_that_is_not_an_entry_is_skipped(line: str) -> None:
    assert Served.parse(line) is None


def test_entries_are_written_and_read_back_oldest_first(tmp_path: Path) -> None:
    path = tmp_path / "traffic.jsonl"
    recorder = _recorder(path)
    for number in range(5):
        recorder.add(_entry(number))
    asyncio.run(recorder.flush())
    assert [e.at for e in read_record(path)] == [1_700_000_000.0 + n for n in range(5)]
    assert (recorder.written, recorder.dropped) == (5, 0)


def test_off_without_a_path(tmp_path: Path) -> None:
    recorder = _recorder(None)
    recorder.add(_entry())
    asyncio.run(recorder.flush())
    assert (recorder.enabled, recorder.written, list(tmp_path.iterdir())) == (False, 0, [])


def test_a_flood_is_dropped_past_the_buffer_and_counted(tmp_path: Path) -> None:
    recorder = _recorder(tmp_path / "traffic.jsonl", buffer=100)
    for number in range(100_000):
        recorder.add(_entry(number))
    assert (recorder.dropped, len(list(recorder._take()))) == (99_900, 100)


def test_the_file_is_rotated_by_size_and_disk_stays_bounded(tmp_path: Path) -> None:
    path = tmp_path / "traffic.jsonl"
    recorder = _recorder(path, max_bytes=4096, buffer=1000)
    line = len(_entry().line()) + 1
    for batch in range(50):
        for number in range(40):
            recorder.add(_entry(batch * 40 + number))
        asyncio.run(recorder.flush())
        on_disk = sum(file.stat().st_size for file in tmp_path.iterdir())
        assert on_disk <= 2 * 4096
    assert sorted(file.name for file in tmp_path.iterdir()) == ["traffic.jsonl", "traffic.jsonl.1"]
    kept = [e.at - 1_700_000_000.0 for e in read_record(path)]
    # The newest entries, in order, and as many as two files hold.
    assert kept == list(range(2000 - len(kept), 2000))
    assert len(kept) >= 4096 // line


def test_an_unwritable_path_drops_and_does_not_raise(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    recorder = _recorder(tmp_path / "file" / "traffic.jsonl")
    recorder.add(_entry())
    asyncio.run(recorder.flush())
    assert (recorder.written, recorder.dropped) == (0, 1)


def test_garbage_in_the_file_is_skipped_when_read(tmp_path: Path) -> None:
    path = tmp_path / "traffic.jsonl"
    path.write_text(_entry(1).line() + "\n" + "x" * 100_000 + "\n\x00\xff\n" + _entry(2).line() + "\n[1,2")
    assert [e.at for e in read_record(path)] == [1_700_000_001.0, 1_700_000_002.0]


@pytest.mark.e2e
def test_the_router_records_what_it_served_and_export_writes_it(tmp_path: Path) -> None:
    path = tmp_path / "traffic.jsonl"
    with running_cluster(traffic={"path": str(path), "flush_seconds": 0.05}) as cluster:
        client = cluster.client("sk-team")
        secret = "the prompt text that must never be written"
        for _chunk in client.chat.completions.create(
            model="test-model", messages=[{"role": "user", "content": secret}], max_tokens=3, stream=True
        ):
            pass
        client.chat.completions.create(
            model="test-model",
            messages=[{"role": "user", "content": "def f(x):\n    return x"}],
            max_tokens=5,
            extra_headers={"X-Job-Type": "batch", "X-Session-ID": "s-1"},
        )
        wait_until(lambda: len(list(read_record(path))) == 2, message="two entries written")
    assert secret not in path.read_text()
    out = tmp_path / "export.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "router.cli", "trace", "export", str(path), "--out", str(out)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "2 requests" in result.stderr
    first, second = (json.loads(line) for line in out.read_text().splitlines())
    assert (first["job"], first["kind"], first["answer_tokens"], first["declared"]) == (
        "interactive",
        "prose",
        3,
        False,
    )
    assert first["prompt_tokens"] > 0 and first["conversation"] is None and first["ttft"] is not None
    assert (second["job"], second["answer_tokens"], second["declared"]) == ("batch", 5, True)
    assert second["conversation"] is not None and "s-1" not in second["conversation"]
    assert first["client"] == second["client"] and "sk-team" not in first["client"]
    assert second["at"] >= first["at"]


@pytest.mark.e2e
def test_the_configured_session_header_names_the_conversation(tmp_path: Path) -> None:
    path = tmp_path / "traffic.jsonl"
    with running_cluster(
        traffic={"path": str(path), "flush_seconds": 0.05}, conversations={"session_header": "X-Thread"}
    ) as cluster:
        client = cluster.client("sk-team")
        for thread in ("t-1", "t-1", "t-2"):
            client.chat.completions.create(
                model="test-model",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=2,
                extra_headers={"X-Thread": thread},
            )
        wait_until(lambda: len(list(read_record(path))) == 3, message="three entries written")
    first, again, other = (entry.conversation for entry in read_record(path))
    assert first is not None and first == again and other not in (None, first)


@pytest.mark.e2e
def test_one_session_id_from_two_clients_is_two_conversations(tmp_path: Path) -> None:
    """A session id is the client's own ("1", "default"): two clients' are not one conversation."""
    path = tmp_path / "traffic.jsonl"
    with running_cluster(traffic={"path": str(path), "flush_seconds": 0.05}) as cluster:
        for key in ("sk-alice-1", "sk-bob-2", "sk-alice-1"):
            client = cluster.client(key)
            client.chat.completions.create(
                model="test-model",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=2,
                extra_headers={"X-Session-ID": "1"},
            )
        wait_until(lambda: len(list(read_record(path))) == 3, message="three entries written")
    alice, bob, alice_again = (entry.conversation for entry in read_record(path))
    assert alice is not None and alice == alice_again and bob not in (None, alice)


def test_export_without_a_record_says_so(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "router.cli", "trace", "export", str(tmp_path / "none.jsonl")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1 and "no traffic record" in result.stderr
