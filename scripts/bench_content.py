#!/usr/bin/env python3
"""What content detection (router/content.py) costs per request, on a large prompt and on the
worst inputs found for the regular expressions it used before google-re2.

Each case is one chat request body; the cost is `detect_kind(request_text(body))`, the router's
whole content classification, on the event loop. Prints a Markdown table: per case, the median
and the maximum of --repeat runs, in milliseconds.

    python scripts/bench_content.py [--repeat 5]

To measure another version of the code, put its `router` package first on the path:
`PYTHONPATH=/tmp/before python scripts/bench_content.py`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from router.content import detect_kind, request_text

MB = 1024 * 1024
PROSE = "The tides of the North Sea rise and fall twice a day, and the moon sets their height. "
CODE = "def area(r):\n    return 3.14159 * r * r\n\n"


def cases() -> dict[str, str]:
    return {
        "a short question (60 B)": "Tell me about the tides of the North Sea, in a few sentences.",
        "1 MB of prose": (PROSE * (MB // len(PROSE) + 1))[:MB],
        "1 MB of code": (CODE * (MB // len(CODE) + 1))[:MB],
        '8 KB: "a" × 8,190 + "("': "a" * 8190 + "(",
        "8 KB of newlines": "\n" * 8191 + "x",
        '8 KB of "\\n\\t"': "\n\t" * 4095 + "x",
        '8 KB of "a("': "a(" * 4096,
        '1 MB: "a" × 1 MB + "("': "a" * MB + "(",
        "1 MB of newlines": "\n" * MB + "x",
    }


def body(text: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text}]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print("| input | kind | median ms | max ms |\n|---|---|---|---|")
    for name, text in cases().items():
        payload = body(text)
        times = []
        for _ in range(args.repeat):
            started = time.perf_counter()
            kind = detect_kind(request_text(payload))
            times.append((time.perf_counter() - started) * 1000)
        print(f"| {name} | {kind} | {statistics.median(times):.3f} | {max(times):.3f} |", flush=True)


if __name__ == "__main__":
    main()
