"""How long the router takes to split one read of N server-sent events (router.sse._events).

A saturated engine writes a whole response at once, so the router reads hundreds of events in
one piece and splits them while looking for the first token and the usage (docs/benchmarks.md
§6). Run it against two checkouts to compare:

    PYTHONPATH=<before> python scripts/bench_sse.py before
    PYTHONPATH=<after>  python scripts/bench_sse.py after
"""

from __future__ import annotations

import sys
import time

from router import sse

EVENT = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":0,"model":"m","choices":'
    b'[{"index":0,"delta":{"content":"hello"},"logprobs":null,"finish_reason":null}]}\n\n'
)


def best_of(runs: int, data: bytes) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        sse._events(data)
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else sse.__file__
    cells = [f"{n}: {best_of(5, EVENT * n) * 1e3:.3f} ms" for n in (16, 64, 256, 1024)]
    print(label, " | ".join(cells))


if __name__ == "__main__":
    main()
