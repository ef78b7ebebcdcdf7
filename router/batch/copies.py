"""`Copies`: the bytes of the temporary copies of stored files open now, against a bound.

A download, and a new batch reading its input, read a copy of the file made for it on the
store's disk (whole even if the file is deleted meanwhile). A client can ask for one with a
request of a few bytes and then leave it unread: without a bound, a 200 MB file downloaded by a
thousand connections would be written a thousand times. The bound is `batch.max_storage_bytes`,
per router process, so its copies take at most as much disk again as the store; one copy alone
is always made (an output file may be larger: a batch's results are written past the limit).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import IO

from router.errors import NoBackendAvailable

RETRY_SECONDS = 5


class Copies:
    def __init__(self) -> None:
        self.held = 0  # bytes of the copies open now
        self._lock = threading.Lock()  # given back from the thread that collects a copy, too

    def take(self, size: int, *, most: int) -> None:
        """Count a copy of `size` bytes about to be made: 503 `batch_copies_full` if it does not fit
        beside those open."""
        with self._lock:
            if self.held and self.held + size > most:
                raise NoBackendAvailable(
                    f"copies of files being read take {self.held} of the {most} bytes allowed "
                    f"(batch.max_storage_bytes), and this one {size}: try again later",
                    retry_after=RETRY_SECONDS,
                    code="batch_copies_full",
                )
            self.held += size

    def track(self, copy: IO[bytes], size: int) -> Callable[[], object]:
        """What gives `size` back, once: call it as `copy` is closed. A copy never closed (a
        response that never started) gives it back as it is collected."""
        return weakref.finalize(copy, self.give_back, size)

    def give_back(self, size: int) -> None:
        with self._lock:
            self.held -= size
