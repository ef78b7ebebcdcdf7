#!/usr/bin/env python3
"""One plot of several `specroute bench sweep` results: plot_sweeps.py OUT.png TITLE LABEL=sweep.json ..."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from router.bench.report import plot_sweeps
from router.bench.scenarios import Summary, SweepRound


def rounds(path: str) -> list[SweepRound]:
    data = json.loads(Path(path).read_text())
    return [
        SweepRound(
            r["users"],
            Summary(
                requests=r["users"],
                errors=r["errors"],
                tokens=r["tokens"],
                total_tps=r["total_tps"],
                per_user_tps=r["per_user_tps"],
                ttft_p50=r["median_ttft"],
                ttft_p99=None,
                ttft_worst=r["worst_ttft"],
            ),
        )
        for r in data["rounds"]
    ]


if __name__ == "__main__":
    out, title, *series = sys.argv[1:]
    plot_sweeps({label: rounds(path) for label, path in (s.split("=", 1) for s in series)}, Path(out), title)
