#!/usr/bin/env python3
"""What sharing between worker processes adds to a request, side by side with one worker.

Processes on loopback: the minimal streaming upstream of bench_router_overhead.py, a router with
one worker (the default: nothing shared), the same with `--workers 2` sharing through the
supervisor's Unix socket (router.workers), and, when redis-server is installed, `--workers 2`
sharing through a Redis of its own instead (each worker a replica there): the two mechanisms
measured in the same run. Each stream opens its own connection, so it lands on either worker.

1. One stream at a time (--single each, sides alternating): the median time to first token.
2. --burst concurrent streams, --bursts times: the median and p99 first token of each side.

    python scripts/bench_workers.py [--single 400 --burst 32 --bursts 20]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from bench_replicas import pct, shared_state_figures
from bench_router_overhead import UPSTREAM, run
from loopback import free_port, wait_until_up


def wait_workers(url: str, count: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if httpx.get(url + "/router/status", timeout=5).json().get("workers", {}).get("answered") == count:
            return
        time.sleep(0.2)
    raise SystemExit(f"{url}: not every worker answers")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--single", type=int, default=400)
    parser.add_argument("--burst", type=int, default=32)
    parser.add_argument("--bursts", type=int, default=20)
    args = parser.parse_args()
    redis_server = shutil.which("redis-server")

    upstream_port, redis_port = free_port(), free_port()
    processes: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "upstream.py"
        script.write_text(UPSTREAM)
        processes.append(subprocess.Popen([sys.executable, str(script), str(upstream_port)]))
        pools = (
            "pools:\n"
            f"  fast: {{speculative: true, backends: {{up: {{url: 'http://127.0.0.1:{upstream_port}', "
            "max_concurrency: 1024}}}\n"
            "classify: {burst_hold_seconds: 0}\n"  # every client here is a new one: no hold measured
        )
        sides = {"one worker": (pools, 1), "2 workers": (pools, 2)}
        if redis_server is not None:
            processes.append(
                subprocess.Popen(
                    [
                        redis_server,
                        "--port",
                        str(redis_port),
                        "--bind",
                        "127.0.0.1",
                        "--save",
                        "",
                        "--appendonly",
                        "no",
                    ],
                    stdout=subprocess.DEVNULL,
                )
            )
            sides["2 via Redis"] = (pools + f"state: {{redis_url: 'redis://127.0.0.1:{redis_port}/0'}}\n", 2)
        urls = {"direct": f"http://127.0.0.1:{upstream_port}"}
        try:
            wait_until_up(urls["direct"] + "/health", processes[0])
            for n, (name, (settings, workers)) in enumerate(sides.items()):
                config = Path(tmp) / f"{n}.yaml"
                config.write_text(settings)
                port = free_port()
                command = [sys.executable, "-m", "router.cli", "serve", "--config", str(config), "--port", str(port)]
                process = subprocess.Popen([*command, "--workers", str(workers), "--log-level", "warning"])
                processes.append(process)
                urls[name] = f"http://127.0.0.1:{port}"
                wait_until_up(urls[name] + "/readyz", process)
                if workers > 1:
                    wait_workers(urls[name], workers)
            for url in urls.values():
                asyncio.run(run(url, args.burst, 2, 0))  # warm: connections opened

            lone: dict[str, list[float]] = {side: [] for side in urls}
            for _ in range(args.single):
                for side, url in urls.items():
                    lone[side] += asyncio.run(run(url, 1, 2, 0))[0]
            medians = {side: statistics.median(values) for side, values in lone.items()}
            print(f"1. one stream at a time, {args.single} each, median time to first token:")
            for side, median in medians.items():
                added = (median - medians["one worker"]) * 1000
                shown = "" if side in ("direct", "one worker") else f"  ({added:+.3f} ms)"
                print(f"   {side:12} {median * 1000:.3f} ms{shown}")

            burst: dict[str, list[float]] = {side: [] for side in urls}
            for _ in range(args.bursts):
                for side, url in urls.items():
                    burst[side] += asyncio.run(run(url, args.burst, 2, 0))[0]
            print(f"2. {args.bursts} bursts of {args.burst} streams at once, time to first token:")
            print("   side           p50        p99")
            for side, values in burst.items():
                print(f"   {side:12} {pct(values, 0.5) * 1000:7.2f}ms {pct(values, 0.99) * 1000:8.2f}ms")
            for side in urls:
                if side not in ("direct", "one worker"):
                    print(f"   {side}: waits for the shared figures: {shared_state_figures(urls[side])}")
        finally:
            for process in reversed(processes):
                process.terminate()
                process.wait(30)


if __name__ == "__main__":
    main()
