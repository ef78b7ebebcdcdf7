#!/usr/bin/env python3
"""The closed-loop load client of scripts/bench_peers.py, one process, aiohttp.

`--streams` workers, the i-th starting at i × ramp / streams; each sends a streamed chat
completion of `--tokens` tokens and, once it ended, the next, until `--duration` seconds have
passed since the first start (a request under way then is still read to its end). Each content
chunk is timed when its read arrives, as an OpenAI client sees it.

Protocol with the harness: prints `ready` once set up and warmed up, waits for a line on stdin, runs, prints
one JSON object (the measurements) and exits.

    python scripts/peers_client.py --url http://127.0.0.1:8000 [--url ...] --streams 128 --tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import re
import sys
import time
from dataclasses import dataclass, field

import aiohttp
import uvloop

# A chunk that carries generated text: `"content":"` followed by anything but the closing quote
# (vLLM's first chunk carries the role and an empty content).
CONTENT = re.compile(rb'"content":\s*"[^"]')


@dataclass
class Tally:
    ttfts: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # one per content chunk: the read's time
    requests: int = 0
    chunks: int = 0
    errors: dict[str, int] = field(default_factory=dict)

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


async def one(session: aiohttp.ClientSession, url: str, body: bytes, tokens: int, tally: Tally) -> None:
    started = time.perf_counter()
    times: list[float] = []
    done = False
    try:
        async with session.post(url, data=body, headers={"content-type": "application/json"}) as response:
            if response.status != 200:
                tally.error(f"http_{response.status}")
                await response.read()
                return
            tail = b""
            async for data in response.content.iter_any():
                now = time.perf_counter()
                # Only complete events count; searched in C (regex, `in`), never split in Python,
                # so that a read carrying hundreds of events costs the client next to nothing.
                data = tail + data
                end = data.rfind(b"\n\n") + 2
                complete, tail = data[:end], data[end:]
                times += [now] * len(CONTENT.findall(complete))
                done = done or b"data: [DONE]" in complete
                if b'data: {"error"' in complete:
                    tally.error("error_event")
    except (TimeoutError, aiohttp.ClientError) as exc:
        tally.error(type(exc).__name__)
        return
    finally:
        tally.requests += 1
        tally.chunks += len(times)
        tally.arrivals += times
        if times:
            tally.ttfts.append(times[0] - started)
            tally.gaps += [b - a for a, b in itertools.pairwise(times)]
    if not done:
        tally.error("no_done")
    elif len(times) != tokens:
        tally.error("short")


async def worker(session: aiohttp.ClientSession, url: str, body: bytes, tokens: int, delay: float,
                 until: float, tally: Tally) -> None:  # fmt: skip
    await asyncio.sleep(delay)
    await one(session, url, body, tokens, tally)
    while time.perf_counter() < until:
        await one(session, url, body, tokens, tally)


def pct(values: list[float], share: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


async def run(args: argparse.Namespace) -> dict[str, object]:
    body = json.dumps({"model": "mock-model", "messages": [{"role": "user", "content": "Tell me about tides."}],
                       "max_tokens": args.tokens, "stream": True}).encode()  # fmt: skip
    urls = [u.rstrip("/") + "/v1/chat/completions" for u in args.url]
    connector = aiohttp.TCPConnector(limit=0, force_close=False, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=60)
    tally = Tally()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        # Warm up (not counted): connections opened from here to the target and on to the engines.
        warm = json.loads(body) | {"max_tokens": 4}
        await asyncio.gather(*(one(session, urls[i % len(urls)], json.dumps(warm).encode(), 4, Tally())
                               for i in range(args.warmup)))  # fmt: skip
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        started, cpu_started = time.perf_counter(), time.process_time()
        until = started + args.duration
        await asyncio.gather(*(
            worker(session, urls[i % len(urls)], body, args.tokens, i * args.ramp / args.streams, until, tally)
            for i in range(args.streams)
        ))  # fmt: skip
        ended = time.perf_counter()
        busy = time.process_time() - cpu_started
    # Delivery rate in the steady part: from the last worker's start to the deadline.
    window = (started + args.ramp, until) if args.duration > args.ramp else (started, ended)
    inside = sum(1 for t in tally.arrivals if window[0] <= t < window[1])
    return {
        "requests": tally.requests,
        "chunks": tally.chunks,
        "errors": sum(tally.errors.values()),
        "error_kinds": tally.errors,
        "elapsed_s": ended - started,
        # Near 1: the client itself was the bottleneck, and the latencies are partly its own.
        "client_cpu_share": busy / (ended - started),
        "chunks_per_s": inside / (window[1] - window[0]),
        "ttft_p50_ms": _ms(pct(tally.ttfts, 0.5)),
        "ttft_p99_ms": _ms(pct(tally.ttfts, 0.99)),
        "ttft_max_ms": _ms(max(tally.ttfts, default=None)),
        "gap_p50_ms": _ms(pct(tally.gaps, 0.5)),
        "gap_p99_ms": _ms(pct(tally.gaps, 0.99)),
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", action="append", required=True, help="a base URL; several: streams alternate")
    parser.add_argument("--streams", type=int, required=True)
    parser.add_argument("--tokens", type=int, required=True)
    parser.add_argument("--ramp", type=float, default=0.0, help="seconds over which the workers start")
    parser.add_argument("--duration", type=float, default=0.0, help="seconds of requests; 0: one each")
    parser.add_argument("--warmup", type=int, default=16, help="requests of 4 tokens before `ready`, at once")
    args = parser.parse_args()
    print(json.dumps(uvloop.run(run(args))), flush=True)


if __name__ == "__main__":
    main()
