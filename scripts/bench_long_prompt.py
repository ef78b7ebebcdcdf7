#!/usr/bin/env python3
"""What a lone request with a long prompt costs the router, two builds side by side.

A chat or an agent sends its whole conversation each turn: tens of kilobytes before the question.
One mock engine (scripts/peers_engine.py) and, in front of it, two routers (`specroute serve`, one
pool, one backend): the build before a change and the one after. Streamed requests of 4 tokens
with a prompt of `--chars` characters go one at a time, in blocks of 50, in turn direct, through
one router and through the other (the order alternating), each on a kept-alive connection. Each
router's CPU (every thread's, from /proc's schedstat, summed over its own blocks) per request,
and the time to the first byte of the answer: its median, and what the router adds over going
direct.

    python scripts/bench_long_prompt.py --before OLD/.venv/bin/specroute --after .venv/bin/specroute \
        [--chars 100000 --requests 300]
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loopback import free_port, wait_until_up

_BLOCK = 50  # requests in a row to one target: its CPU is read before and after them


def _cpu_seconds(pid: int) -> float:
    """CPU time of every thread of `pid`, to the nanosecond (/proc's schedstat; its stat counts
    10 ms ticks, as much as a request of this benchmark costs)."""
    threads = Path(f"/proc/{pid}/task").iterdir()
    return sum(int((thread / "schedstat").read_text().split()[0]) for thread in threads) / 1e9


def _first_byte(connection: http.client.HTTPConnection, body: bytes) -> float:
    """Seconds to the first byte of the answer; the answer is read to its end."""
    started = time.perf_counter()
    connection.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
    answer = connection.getresponse()
    answer.read1()
    first = time.perf_counter() - started
    answer.read()
    return first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, help="the specroute executable before the change")
    parser.add_argument("--after", required=True, help="the specroute executable after it")
    parser.add_argument("--chars", type=int, default=100_000, help="characters of the prompt")
    parser.add_argument("--requests", type=int, default=300, help="per target, after 30 to warm up")
    args = parser.parse_args()

    body = json.dumps({
        "model": "mock-model",
        "messages": [{"role": "system", "content": "word " * (args.chars // 5)}, {"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "stream": True,
    }).encode()  # fmt: skip
    here = Path(__file__).parent
    processes: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            engine_port = free_port()
            engine = subprocess.Popen([sys.executable, str(here / "peers_engine.py"), "--port", str(engine_port)])
            processes.append(engine)
            wait_until_up(f"http://127.0.0.1:{engine_port}/health", engine)
            config = Path(tmp) / "router.yaml"
            backend = f"{{url: 'http://127.0.0.1:{engine_port}', max_concurrency: 1024}}"
            config.write_text(f"pools:\n  fast: {{speculative: true, backends: {{up: {backend}}}}}\n")
            ports = {"direct": engine_port}
            pids = {}
            for name in ("before", "after"):
                port = free_port()
                command = [getattr(args, name), "serve", "--config", str(config), "--port", str(port)]
                router = subprocess.Popen([*command, "--log-level", "warning"])
                processes.append(router)
                wait_until_up(f"http://127.0.0.1:{port}/health", router)
                ports[name], pids[name] = port, router.pid
            connections = {name: http.client.HTTPConnection("127.0.0.1", port) for name, port in ports.items()}
            for connection in connections.values():
                for _ in range(30):
                    _first_byte(connection, body)
            firsts: dict[str, list[float]] = {name: [] for name in connections}
            cpu = dict.fromkeys(pids, 0.0)
            for block in range(args.requests // _BLOCK):
                for name in ("direct", "before", "after") if block % 2 else ("direct", "after", "before"):
                    used = _cpu_seconds(pids[name]) if name in pids else 0.0
                    firsts[name] += [_first_byte(connections[name], body) for _ in range(_BLOCK)]
                    if name in pids:
                        cpu[name] += _cpu_seconds(pids[name]) - used
        finally:
            for process in processes:
                process.terminate()
                process.wait()

    direct = statistics.median(firsts["direct"])
    requests = args.requests // _BLOCK * _BLOCK
    print(f"prompt {args.chars} characters (body {len(body)} bytes), {requests} requests per target")
    print("| target | router CPU per request | first byte p50 | added over direct |")
    print("|---|---|---|---|")
    print(f"| direct | - | {direct * 1000:.3f} ms | - |")
    for name in pids:
        first = statistics.median(firsts[name])
        per_request = cpu[name] / requests * 1000
        print(f"| {name} | {per_request:.3f} ms | {first * 1000:.3f} ms | +{(first - direct) * 1000:.3f} ms |")


if __name__ == "__main__":
    main()
