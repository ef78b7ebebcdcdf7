"""The traffic record: what the router served, compact and bounded, for `specroute plan` to replay.

The observe stage hands each finished request's entry (router.record) to `TrafficRecorder.add`,
which only appends to a bounded buffer; a background task writes the buffer to a file, moved
aside to `<path>.1` when it reaches `max_bytes`. A flood drops entries (counted), it never grows
memory or disk past the settings.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from pathlib import Path

from router.clock import Clock
from router.config import Traffic
from router.record import Served, older_file

logger = logging.getLogger("specroute")


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
                os.replace(target, older_file(target))  # one older file is kept: at most 2 x max_bytes
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
