#!/usr/bin/env python3
"""What sharing state through Redis adds to a request, side by side with a router alone.

Processes on loopback: the minimal streaming upstream of bench_router_overhead.py, a
redis-server of its own, a router alone (no `state`), and two routers sharing that Redis, each
the other's live peer: "round trip" claims every request's slot in a round trip
(`state.lease_slots: 0`), "leased" takes slots it holds ahead (the default); then this load
generator. Two measurements, each side in turn in the same run:

1. One stream at a time (--single each): the median time to first token, and what sharing adds.
2. --burst concurrent streams, --bursts times: the median and p99 first token of each side.

The sharing routers' own `specroute_shared_state_seconds` (their wait for Redis per call) and
fallbacks are printed at the end: a run where one fell back measured a router alone. Beside the
lone streams, the floor: a bare PING and a one-line script (EVALSHA) to the same Redis from an
asyncio client in this process, what one loopback round trip costs under the load of the moment.

    python scripts/bench_replicas.py [--single 400 --burst 32 --bursts 20]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import redis.asyncio as redis
from bench_router_overhead import UPSTREAM, run
from loopback import free_port, wait_until_up

from router.quantiles import percentile


def pct(values: list[float], share: float) -> float:
    return percentile(values, share) or math.nan


async def floor(port: int, times: int) -> tuple[float, float]:
    """The median of a PING and of a one-line script's round trip to Redis, in seconds."""
    client = redis.Redis(port=port)
    script = client.register_script("return 1")
    await client.ping()
    await script()  # connected, and the script loaded
    pings, scripts = [], []
    for _ in range(times):
        started = time.perf_counter()
        await client.ping()
        pings.append(time.perf_counter() - started)
        started = time.perf_counter()
        await script()
        scripts.append(time.perf_counter() - started)
    await client.aclose()
    return statistics.median(pings), statistics.median(scripts)


def shared_state_figures(url: str) -> str:
    values = {}
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        for name in ("_sum", "_count"):
            if line.startswith(f"specroute_shared_state_seconds{name}"):
                call = line.split('call="', 1)[1].split('"', 1)[0]
                values[call + name] = float(line.rsplit(" ", 1)[1])
        if line.startswith("specroute_shared_state_fallbacks_total "):
            values["fallbacks"] = float(line.rsplit(" ", 1)[1])
    calls = []
    for call in ("client", "claim", "lease"):
        count = values.get(call + "_count")
        if count:
            calls.append(f"{call}: {count:.0f} calls, mean {values[call + '_sum'] / count * 1e3:.3f} ms")
    return "; ".join(calls) + f"; fallbacks {values.get('fallbacks', 0):.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--single", type=int, default=400)
    parser.add_argument("--burst", type=int, default=32)
    parser.add_argument("--bursts", type=int, default=20)
    args = parser.parse_args()
    redis_server = shutil.which("redis-server")
    if redis_server is None:
        raise SystemExit("redis-server is not installed (apt-get install redis-server)")

    upstream_port, redis_port = free_port(), free_port()
    processes: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "upstream.py"
        script.write_text(UPSTREAM)
        processes.append(subprocess.Popen([sys.executable, str(script), str(upstream_port)]))
        processes.append(
            subprocess.Popen(
                [redis_server, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                stdout=subprocess.DEVNULL,
            )
        )
        pools = (
            "pools:\n"
            f"  fast: {{speculative: true, backends: {{up: {{url: 'http://127.0.0.1:{upstream_port}', "
            "max_concurrency: 1024}}}\n"
            # Held requests would measure the hold: every client here is a new one each time.
            "classify: {burst_hold_seconds: 0}\n"
        )
        state = f"state: {{redis_url: 'redis://127.0.0.1:{redis_port}/0', lease_slots: %d}}\n"
        urls = {}
        for name, settings in (("alone", pools), ("round trip", pools + state % 0), ("leased", pools + state % 4)):
            config = Path(tmp) / f"{name.replace(' ', '-')}.yaml"
            config.write_text(settings)
            port = free_port()
            command = [sys.executable, "-m", "router.cli", "serve", "--config", str(config), "--port", str(port)]
            processes.append(subprocess.Popen([*command, "--log-level", "warning"]))
            urls[name] = f"http://127.0.0.1:{port}"
        try:
            direct = f"http://127.0.0.1:{upstream_port}"
            wait_until_up(direct + "/health", processes[0])
            for name, url in urls.items():
                wait_until_up(url + "/readyz", processes[2 + list(urls).index(name)])
            sides = {"direct": direct, **urls}
            for url in sides.values():
                asyncio.run(run(url, args.burst, 2, 0))  # warm: connections opened, scripts loaded

            lone: dict[str, list[float]] = {side: [] for side in sides}
            pings, scripts = [], []  # round trips to the same Redis, as the load of the moment makes them
            for _ in range(args.single):
                for side, url in sides.items():
                    lone[side] += asyncio.run(run(url, 1, 2, 0))[0]
                ping, script = asyncio.run(floor(redis_port, 1))
                pings.append(ping)
                scripts.append(script)
            medians = {side: statistics.median(values) for side, values in lone.items()}
            print(f"1. one stream at a time, {args.single} each, median time to first token:")
            for side, median in medians.items():
                print(f"   {side:10} {median * 1000:.3f} ms")
            for side in ("round trip", "leased"):
                added = (medians[side] - medians["alone"]) * 1000
                print(f"   {side} adds {added:+.3f} ms to the router alone's")
            print(f"   to the same Redis from here, median: PING {statistics.median(pings) * 1000:.3f} ms,", end=" ")
            print(f"a one-line script {statistics.median(scripts) * 1000:.3f} ms")
            for side in ("round trip", "leased"):
                print(f"   {side}, its waits for Redis so far: {shared_state_figures(urls[side])}")

            burst: dict[str, list[float]] = {side: [] for side in sides}
            for _ in range(args.bursts):
                for side, url in sides.items():
                    burst[side] += asyncio.run(run(url, args.burst, 2, 0))[0]
            print(f"2. {args.bursts} bursts of {args.burst} streams at once, time to first token:")
            print("   side         p50        p99")
            for side, values in burst.items():
                print(f"   {side:10} {pct(values, 0.5) * 1000:7.2f}ms {pct(values, 0.99) * 1000:8.2f}ms")
            for side in ("round trip", "leased"):
                added = (pct(burst[side], 0.5) - pct(burst["alone"], 0.5)) * 1000
                print(f"   {side} adds {added:+.2f} ms to the median")
                print(f"   its waits for Redis: {shared_state_figures(urls[side])}")
        finally:
            for process in reversed(processes):
                process.terminate()
                process.wait(10)


if __name__ == "__main__":
    main()
