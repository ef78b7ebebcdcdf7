"""Whether this machine can time anything right now.

A check read off the wall clock (a simulator's real-time speed, a benchmark's direction) measures
the machine rather than the code when other work keeps every core busy: such a test runs, then
skips with this reason instead of judging. Everything else holds however busy the machine is.
"""

from __future__ import annotations

import os


def too_busy_to_time() -> str | None:
    """The reason, if the last minute's load was past one and a half times the cores."""
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    return f"too busy to time: load {load:.1f} on {cores} cores" if load > 1.5 * cores else None
