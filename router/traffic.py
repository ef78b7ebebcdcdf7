"""The traffic record: what the router served, compact and bounded, for `specroute plan` to replay.

One line per finished request: when it arrived, its job class and content kind, its prompt and
answer tokens, and hashes of its client and conversation; never a prompt or an answer. The
observe stage hands each entry to `TrafficRecorder.add`, which only appends to a bounded buffer;
a background task writes the buffer to a file, moved aside to `<path>.1` when it reaches
`max_bytes`. A flood drops entries (counted), it never grows memory or disk past the settings.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from router.clock import Clock
from router.config import Traffic

logger = logging.getLogger("specroute")

FORMAT = 1  # the first field of every line; a line of another format is skipped when read


@dataclass(frozen=True, slots=True)
class Served:
    """One request in the record."""

    at: float  # Unix seconds at arrival
    job: str  # interactive | batch
    kind: str  # prose | code
    prompt_tokens: int
    answer_tokens: int
    status: int
    client: str | None = None  # a hash, as the access log shows it
    conversation: str | None = None  # a hash of its session header or the response it continues
    declared: bool = False  # the client named its job type (header or rule): replayed as declared
    ttft: float | None = None  # seconds, as the router saw it
    duration: float = 0.0

    def line(self) -> str:
        return json.dumps(
            [FORMAT, round(self.at, 3), self.job, self.kind, self.prompt_tokens, self.answer_tokens, self.status,
             self.client, self.conversation, int(self.declared),
             None if self.ttft is None else round(self.ttft, 4), round(self.duration, 4)],
            separators=(",", ":"),
        )  # fmt: skip

    @classmethod
    def parse(cls, line: str) -> Served | None:
        """An entry from one line of the record, or None for a line that is not one (a torn last
        line, another format, a file edited by hand)."""
        try:
            row = json.loads(line)
            if not isinstance(row, list) or len(row) != 12 or row[0] != FORMAT:
                return None
            _, at, job, kind, prompt, answer, status, client, conversation, declared, ttft, duration = row
            entry = cls(
                at=float(at), job=str(job), kind=str(kind), prompt_tokens=int(prompt), answer_tokens=int(answer),
                status=int(status), client=None if client is None else str(client),
                conversation=None if conversation is None else str(conversation), declared=bool(declared),
                ttft=None if ttft is None else float(ttft), duration=float(duration),
            )  # fmt: skip
        except (ValueError, TypeError):
            return None
        if entry.job not in ("interactive", "batch") or entry.kind not in ("prose", "code"):
            return None
        if min(entry.prompt_tokens, entry.answer_tokens) < 0 or not 0 <= entry.at < 1e11:
            return None
        return entry

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def conversation_hash(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()[:12]


class TrafficRecorder:
    """Takes entries on the request path (`add`: an append, nothing more) and writes them in the
    background (`run`). Off until configured with a path."""

    def __init__(self, *, clock: Clock) -> None:
        self._clock = clock
        # Wall-clock time of a reading of the router's clock: arrivals are recorded in Unix seconds.
        self._epoch = time.time() - clock.now()
        self.config = Traffic()
        self._buffer: deque[Served] = deque()
        self._wake = asyncio.Event()
        self.written = 0
        self.dropped = 0

    @property
    def enabled(self) -> bool:
        return self.config.path is not None

    def configure(self, config: Traffic) -> None:
        self.config = config

    def wall(self, now: float) -> float:
        """Unix seconds of a reading of the router's clock."""
        return self._epoch + now

    def add(self, entry: Served) -> None:
        if not self.enabled:
            return
        if len(self._buffer) >= self.config.buffer:
            self.dropped += 1  # the writer is behind (a slow disk, a flood): drop, never block or grow
            return
        self._buffer.append(entry)
        if len(self._buffer) >= self.config.buffer // 2:
            self._wake.set()

    async def run(self) -> None:
        """Write what was added, every `flush_seconds` or when the buffer is half full; the rest
        once more when cancelled."""
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.config.flush_seconds)
                self._wake.clear()
                await self.flush()
        finally:
            self._write_now(self._take())

    async def flush(self) -> None:
        entries = self._take()
        if entries:
            await asyncio.to_thread(self._write_now, entries)

    def _take(self) -> list[Served]:
        entries = list(self._buffer)
        self._buffer.clear()
        return entries

    def _write_now(self, entries: list[Served]) -> None:
        path = self.config.path
        if path is None or not entries:
            return
        data = "".join(entry.line() + "\n" for entry in entries).encode()
        target = Path(path)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            size = target.stat().st_size if target.exists() else 0
            if size and size + len(data) > self.config.max_bytes:
                os.replace(target, _older(target))  # one older file is kept: at most 2 x max_bytes
            if len(data) > self.config.max_bytes:  # more than a whole file at once: the newest part
                cut = data.index(b"\n", len(data) - self.config.max_bytes) + 1 if self.config.max_bytes else len(data)
                self.dropped += data[:cut].count(b"\n")
                data = data[cut:]
            with target.open("ab") as file:
                file.write(data)
            self.written += data.count(b"\n")
        except OSError as exc:
            self.dropped += len(entries)
            logger.warning("traffic record: cannot write %s: %s", path, exc.strerror or exc)


def _older(path: Path) -> Path:
    return path.with_name(path.name + ".1")


def read_record(path: str | Path) -> Iterator[Served]:
    """The entries of a record, oldest first: the file moved aside, then the current one.
    Lines that are not entries are skipped."""
    target = Path(path)
    for file in (_older(target), target):
        if not file.exists():
            continue
        with file.open("r", encoding="utf-8", errors="replace") as lines:
            for line in lines:
                if len(line) > 4096:
                    continue
                entry = Served.parse(line)
                if entry is not None:
                    yield entry
